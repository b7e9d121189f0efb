//! The `Persist` trait each stateful object implements next to its own code. A leaf: devices
//! import it, and the machine state (`persist/mod.rs`) imports the devices' states.

/// Saves an object's state and builds the object again from it. `Args` is what the state does
/// not hold: host resources (files, eventfds, sinks) the new object is connected to.
pub trait Persist: Sized {
    type State;
    type Args;
    fn save(&self) -> Self::State;
    fn restore(args: Self::Args, state: &Self::State) -> Result<Self, String>;
}
