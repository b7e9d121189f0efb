//! virt-controller. `virt-controller crds` prints the CustomResourceDefinitions.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "virt-controller",
    version,
    about = "microvirt's cluster controller"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions (kubectl apply -f - installs them).
    Crds,
}

fn main() {
    match Cli::parse().command {
        Command::Crds => print!("{}", controller::crds::yaml()),
    }
}
