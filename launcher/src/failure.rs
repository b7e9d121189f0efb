//! How a launcher command fails: a configuration the user must fix, or the host, each with
//! its exit status. The binary prints the message and exits with the code.

/// Why a command could not do what it was asked; the process exits with [`Failure::exit_code`].
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The user must fix the configuration; nothing was started (exit 2).
    #[error("{0}")]
    BadConfig(String),
    /// The host failed (KVM unavailable, out of memory, a peer gone, ...) (exit 1).
    #[error("{0}")]
    Host(String),
}

/// Exit status for a configuration the user must fix; nothing was started.
pub const EXIT_BAD_CONFIG: u8 = 2;
/// Exit status for a host failure (KVM unavailable, out of memory, ...).
pub const EXIT_HOST_ERROR: u8 = 1;

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::BadConfig(_) => EXIT_BAD_CONFIG,
            Failure::Host(_) => EXIT_HOST_ERROR,
        }
    }
}

pub fn bad_config(msg: impl std::fmt::Display) -> Failure {
    Failure::BadConfig(msg.to_string())
}

pub fn host_error(msg: impl std::fmt::Display) -> Failure {
    Failure::Host(msg.to_string())
}
