//! virtctl: KubeVirt's command line for what `kubectl` cannot say — start, stop, restart and
//! migrate a VM, and the VMI queries — through virt-api's `subresources.kubevirt.io`. Also
//! installed as `kubectl-virt`, so `kubectl virt …` runs it. Kubeconfig, contexts and
//! namespaces as kubectl takes them. Exit status 0 on success, 1 when the cluster refused or
//! could not be reached (the reason on stderr), 2 for a usage error.

use std::path::PathBuf;

use anyhow::Context;
use api::VirtualMachineInstanceMigration;
use clap::{Args, Parser, Subcommand};
use controller_runtime::websocket::{relay, AtEnd};
use kube::api::{Api, DeleteParams, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::ResourceExt;
use serde_json::json;
use virt_api::client::Subresources;

#[derive(Parser)]
#[command(
    name = "virtctl",
    version,
    about = "Control microvirt (KubeVirt API) virtual machines"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct Global {
    /// The namespace of the VM (default: the context's namespace, else "default").
    #[arg(short = 'n', long, global = true)]
    namespace: Option<String>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    /// The kubeconfig file (default: $KUBECONFIG, else ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
}

/// What `ssh` and `scp` pass on to the local ssh.
#[derive(Args)]
struct SshOptions {
    /// The guest's ssh port.
    #[arg(short = 'p', long, default_value_t = 22)]
    port: u16,
    /// The user (else the one in the target, else ssh's default).
    #[arg(short = 'l', long)]
    username: Option<String>,
    #[arg(short = 'i', long)]
    identity_file: Option<PathBuf>,
    /// More options for the local ssh (e.g. `-o StrictHostKeyChecking=no`); repeatable.
    #[arg(long, allow_hyphen_values = true)]
    local_ssh_opts: Vec<String>,
}

/// How a stop (or the stop of a restart) goes.
#[derive(Args)]
struct Stopping {
    /// Shorten the guest's shutdown to this many seconds (with --force).
    #[arg(long)]
    grace_period: Option<i64>,
    /// Force the stop (with --grace-period).
    #[arg(long)]
    force: bool,
    /// Check the request without changing anything.
    #[arg(long)]
    dry_run: bool,
}

impl Stopping {
    /// The options body, the grace period under `grace_field` (KubeVirt names it
    /// `gracePeriod` for stop, `gracePeriodSeconds` for restart).
    fn body(&self, grace_field: &str) -> anyhow::Result<serde_json::Value> {
        let mut body = json!({"dryRun": dry_run(self.dry_run)});
        if let Some(g) = grace(self.force, self.grace_period)? {
            body[grace_field] = json!(g);
        }
        Ok(body)
    }
}

#[derive(Args)]
struct ImageUploadArgs {
    #[arg(value_parser = ["dv"])]
    kind: String,
    name: String,
    /// The DataVolume's size (needed to create it).
    #[arg(long)]
    size: Option<String>,
    /// The image file (raw or qcow2, optionally gz/xz/zst).
    #[arg(long)]
    image_path: std::path::PathBuf,
    /// The upload proxy: virt-api's address (https://…), reachable from here.
    #[arg(long)]
    uploadproxy_url: String,
    /// Accept the proxy's certificate unchecked.
    #[arg(long)]
    insecure: bool,
    /// Upload into an existing DataVolume.
    #[arg(long)]
    no_create: bool,
    #[arg(long)]
    storage_class: Option<String>,
    #[arg(long)]
    access_mode: Option<String>,
    #[arg(long)]
    volume_mode: Option<String>,
    /// Seconds to wait for the upload server and for the processing.
    #[arg(long, default_value_t = 300)]
    wait_secs: u64,
}

impl ImageUploadArgs {
    fn request(self, namespace: &str) -> virt_api::image_upload::UploadRequest {
        virt_api::image_upload::UploadRequest {
            name: self.name,
            namespace: namespace.to_string(),
            size: self.size,
            image_path: self.image_path,
            proxy_url: self.uploadproxy_url,
            insecure: self.insecure,
            no_create: self.no_create,
            storage_class: self.storage_class,
            access_mode: self.access_mode,
            volume_mode: self.volume_mode,
            wait: std::time::Duration::from_secs(self.wait_secs),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Start a virtual machine.
    Start {
        name: String,
        /// Start the VM paused.
        #[arg(long)]
        paused: bool,
        /// Check the request without changing anything.
        #[arg(long)]
        dry_run: bool,
    },
    /// Stop a virtual machine.
    Stop {
        name: String,
        #[command(flatten)]
        how: Stopping,
    },
    /// Restart a virtual machine.
    Restart {
        name: String,
        #[command(flatten)]
        how: Stopping,
    },
    /// Live-migrate a virtual machine to another node.
    Migrate {
        name: String,
        #[arg(long)]
        dry_run: bool,
    },
    /// Cancel a virtual machine's live migration (the VM stays where it runs).
    MigrateCancel { name: String },
    /// The guest OS as its guest agent reports it.
    Guestosinfo { name: String },
    /// The users logged in to the guest, as its guest agent reports them.
    Userlist { name: String },
    /// The guest's file systems, as its guest agent reports them.
    Fslist { name: String },
    /// Connect to the VMI's serial console (Ctrl-] leaves).
    Console { name: String },
    /// Forward local ports to ports of a VM's guest: `vm/NAME[.NAMESPACE] LOCAL:REMOTE…`
    /// (or `vmi/…`); with --stdio one connection on stdin/stdout (for ssh's ProxyCommand).
    PortForward {
        target: String,
        #[arg(required = true)]
        ports: Vec<String>,
        /// Carry one connection on stdin and stdout instead of listening.
        #[arg(long)]
        stdio: bool,
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1")]
        address: std::net::IpAddr,
    },
    /// ssh into a VM's guest through port-forward: `[user@]vm|vmi/NAME[.NAMESPACE]`, the
    /// local `ssh` with virtctl as its ProxyCommand.
    Ssh {
        target: String,
        #[command(flatten)]
        ssh: SshOptions,
        /// Run this command instead of a shell.
        #[arg(short = 'c', long)]
        command: Option<String>,
    },
    /// Copy files to or from a VM's guest: one of SRC and DST is `[user@]vm|vmi/NAME[.NS]:PATH`.
    Scp {
        source: String,
        destination: String,
        #[command(flatten)]
        ssh: SshOptions,
        /// Copy directories.
        #[arg(short = 'r', long)]
        recursive: bool,
    },
    /// Pause a running VM (`vm NAME`) or VMI (`vmi NAME`).
    Pause {
        #[arg(value_parser = ["vm", "vmi"])]
        kind: String,
        name: String,
    },
    /// Unpause a paused VM or VMI.
    Unpause {
        #[arg(value_parser = ["vm", "vmi"])]
        kind: String,
        name: String,
    },
    /// Ask the guest of a running VMI to reboot; the VMI and its Pod stay.
    #[command(name = "soft-reboot")]
    SoftReboot { name: String },
    /// Open a VNC connection to the VMI's display.
    Vnc { name: String },
    /// Print the client and server versions.
    Version,
    /// Upload a disk image into a DataVolume (made unless --no-create), through the upload
    /// proxy.
    ImageUpload(ImageUploadArgs),
    /// Print a VM with its instance type and preference applied.
    Expand {
        #[arg(long = "vm")]
        vm: String,
        /// yaml or json.
        #[arg(short = 'o', long, default_value = "yaml", value_parser = ["yaml", "json"])]
        output: String,
    },
    /// Write a manifest from flags (print it; `| kubectl apply -f -` creates it).
    Create {
        #[command(subcommand)]
        what: Create,
    },
    /// Make a Service for a VM, VMI or VMI ReplicaSet.
    Expose {
        #[arg(value_parser = ["vm", "vmi", "vmirs", "virtualmachine", "virtualmachineinstance", "virtualmachineinstancereplicaset"])]
        kind: String,
        name: String,
        /// The Service's name.
        #[arg(long = "name")]
        service_name: String,
        #[arg(long)]
        port: i32,
        /// The port in the guest (default: --port).
        #[arg(long)]
        target_port: Option<i32>,
        #[arg(long = "type", default_value = "ClusterIP")]
        service_type: String,
        #[arg(long, default_value = "TCP")]
        protocol: String,
    },
}

#[derive(Subcommand)]
enum Create {
    /// A VirtualMachine.
    Vm(virt_api::create::VmFlags),
}

async fn connect(g: &Global) -> anyhow::Result<Subresources> {
    let opts = KubeConfigOptions {
        context: g.context.clone(),
        ..Default::default()
    };
    let config = match &g.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("--kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &opts).await?
        }
        None => match kube::Config::from_kubeconfig(&opts).await {
            Ok(c) => c,
            Err(e) => kube::Config::incluster().map_err(|_| e).context(
                "no kubeconfig ($KUBECONFIG, ~/.kube/config or --kubeconfig) and not in a cluster",
            )?,
        },
    };
    // kube's clients retry 503s for up to minutes; a person at a terminal (or a script) is
    // told at once, as KubeVirt's virtctl does.
    let mut config = config;
    config.default_retry = false;
    let namespace = g
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    Ok(Subresources {
        client: kube::Client::try_from(config)?,
        namespace,
    })
}

fn dry_run(on: bool) -> serde_json::Value {
    if on {
        json!(["All"])
    } else {
        json!([])
    }
}

/// A VM verb, and KubeVirt's words for its outcome.
async fn vm_verb(
    s: &Subresources,
    name: &str,
    verb: &str,
    body: serde_json::Value,
    dry: bool,
) -> anyhow::Result<()> {
    let doing = match verb {
        "start" => "starting",
        "stop" => "stopping",
        "restart" => "restarting",
        _ => "migrating",
    };
    s.vm_verb(name, verb, &body)
        .await
        .with_context(|| format!("Error {doing} VirtualMachine {name}"))?;
    let note = if dry {
        " (dry run: nothing changed)"
    } else {
        ""
    };
    println!("VM {name} was scheduled to {verb}{note}");
    Ok(())
}

/// KubeVirt's rule: a grace period only together with --force.
fn grace(force: bool, grace_period: Option<i64>) -> anyhow::Result<Option<i64>> {
    match (force, grace_period) {
        (true, Some(g)) => Ok(Some(g)),
        (false, None) => Ok(None),
        _ => anyhow::bail!("--force and --grace-period go together: give both, or neither"),
    }
}

/// `create vm`: needs no cluster.
fn create(what: Create) -> anyhow::Result<()> {
    let Create::Vm(flags) = what;
    let vm = virt_api::create::vm_manifest(&flags).map_err(anyhow::Error::msg)?;
    print!("{}", serde_yaml::to_string(&vm)?);
    Ok(())
}

/// An API error in the API server's own words (kube's Display repeats them with the whole
/// Status).
fn api_error(e: kube::Error) -> anyhow::Error {
    match e {
        kube::Error::Api(s) => anyhow::Error::msg(s.message),
        other => other.into(),
    }
}

/// `expose`: the Service for what `kind`/`name` is, by its Pods' labels.
async fn expose(
    s: &Subresources,
    kind: &str,
    name: &str,
    flags: virt_api::expose::ExposeFlags,
) -> anyhow::Result<()> {
    use api::{VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceReplicaSet};
    let ns = s.namespace.clone();
    let (kind, labels) = match kind {
        "vm" | "virtualmachine" => {
            let vm = Api::<VirtualMachine>::namespaced(s.client.clone(), &ns)
                .get(name)
                .await?;
            let labels = vm.spec.template.metadata.and_then(|m| m.labels);
            ("VirtualMachine", labels.unwrap_or_default())
        }
        "vmi" | "virtualmachineinstance" => {
            let vmi = Api::<VirtualMachineInstance>::namespaced(s.client.clone(), &ns)
                .get(name)
                .await
                .map_err(api_error)?;
            (
                "VirtualMachineInstance",
                vmi.metadata.labels.unwrap_or_default(),
            )
        }
        _ => {
            let rs = Api::<VirtualMachineInstanceReplicaSet>::namespaced(s.client.clone(), &ns)
                .get(name)
                .await
                .map_err(api_error)?;
            let labels = rs.spec.target.selector.match_labels.unwrap_or_default();
            ("VirtualMachineInstanceReplicaSet", labels)
        }
    };
    let svc =
        virt_api::expose::service(kind, name, &ns, labels, &flags).map_err(anyhow::Error::msg)?;
    Api::<k8s_openapi::api::core::v1::Service>::namespaced(s.client.clone(), &ns)
        .create(&Default::default(), &svc)
        .await
        .map_err(api_error)
        .with_context(|| format!("Error exposing {kind} {name}"))?;
    println!(
        "Service {} successfully exposed for {kind} {name}",
        flags.service_name
    );
    Ok(())
}

/// migrate-cancel: the VMI's unfinished migration deleted (the VM stays where it runs).
async fn migrate_cancel(s: &Subresources, name: &str) -> anyhow::Result<()> {
    let vmims: Api<VirtualMachineInstanceMigration> =
        Api::namespaced(s.client.clone(), &s.namespace);
    let all = vmims
        .list(&ListParams::default())
        .await
        .map_err(api_error)?
        .items;
    let Some(m) = VirtualMachineInstanceMigration::unfinished_of(&all, name) else {
        anyhow::bail!("Found no migration to cancel for {name}");
    };
    vmims
        .delete(&m.name_any(), &DeleteParams::default())
        .await
        .map_err(api_error)
        .with_context(|| format!("Error canceling migration {}", m.name_any()))?;
    println!(
        "VM {name} was scheduled to cancel its migration ({})",
        m.name_any()
    );
    Ok(())
}

/// scp's arguments: exactly one of `source` and `destination` is in the guest.
fn scp_args(
    g: &Global,
    namespace: &str,
    ssh: &SshOptions,
    recursive: bool,
    source: String,
    destination: String,
) -> anyhow::Result<Vec<String>> {
    let (target, path, local_is_source) = match (remote_spec(&source), remote_spec(&destination)) {
        (Some((t, p)), None) => (t, p, false),
        (None, Some((t, p))) => (t, p, true),
        _ => anyhow::bail!(
            "exactly one of {source:?} and {destination:?} must be [user@]vm|vmi/NAME[.NS]:PATH"
        ),
    };
    let r = SshTarget::parse(target, namespace)?;
    let mut args = ssh_args(g, ssh, &r)?;
    if recursive {
        args.push("-r".into());
    }
    // scp takes a '/' before the ':' for a local path: the host goes by a name without one,
    // its key checked under ssh's name for it.
    args.extend(["-o".to_string(), format!("HostKeyAlias={}", r.host())]);
    let host = format!("{}.{}.{}", r.kind, r.name, r.namespace);
    let remote = match ssh.username.as_deref().or(r.user.as_deref()) {
        Some(u) => format!("{u}@{host}:{path}"),
        None => format!("{host}:{path}"),
    };
    if local_is_source {
        args.extend([source, remote]);
    } else {
        args.extend([remote, destination]);
    }
    Ok(args)
}

/// expand: expand-spec, printed as YAML or JSON.
async fn expand(s: &Subresources, vm: &str, output: &str) -> anyhow::Result<()> {
    let v = s
        .vm_get(vm, "expand-spec")
        .await
        .with_context(|| format!("Error expanding VirtualMachine {vm}"))?;
    match output {
        "json" => println!("{}", serde_json::to_string_pretty(&v)?),
        _ => print!("{}", serde_yaml::to_string(&v)?),
    }
    Ok(())
}

/// version: the client's, then virt-api's.
async fn version(s: &Subresources) -> anyhow::Result<()> {
    println!(
        "Client Version: version.Info{{GitVersion:\"v{}-microvirt\"}}",
        env!("CARGO_PKG_VERSION")
    );
    let v = s
        .server_version()
        .await
        .context("Error getting the server version")?;
    println!(
        "Server Version: version.Info{{GitVersion:{}}}",
        v.get("gitVersion").cloned().unwrap_or_default()
    );
    Ok(())
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let command = match cli.command {
        Command::Create { what } => return create(what),
        other => other,
    };
    let s = connect(&cli.global).await?;
    match command {
        Command::Create { .. } => unreachable!("handled above"),
        Command::Expose {
            kind,
            name,
            service_name,
            port,
            target_port,
            service_type,
            protocol,
        } => {
            let flags = virt_api::expose::ExposeFlags {
                service_name,
                port,
                target_port,
                service_type,
                protocol,
            };
            expose(&s, &kind, &name, flags).await?;
        }
        Command::Start {
            name,
            paused,
            dry_run: dry,
        } => {
            let body = json!({"paused": paused, "dryRun": dry_run(dry)});
            vm_verb(&s, &name, "start", body, dry).await?;
        }
        Command::Stop { name, how } => {
            vm_verb(&s, &name, "stop", how.body("gracePeriod")?, how.dry_run).await?;
        }
        Command::Restart { name, how } => {
            let body = how.body("gracePeriodSeconds")?;
            vm_verb(&s, &name, "restart", body, how.dry_run).await?;
        }
        Command::Migrate { name, dry_run: dry } => {
            vm_verb(&s, &name, "migrate", json!({"dryRun": dry_run(dry)}), dry).await?;
        }
        Command::MigrateCancel { name } => migrate_cancel(&s, &name).await?,
        Command::Console { name } => console(&s, &name).await?,
        Command::Ssh {
            target,
            ssh,
            command,
        } => {
            let remote = SshTarget::parse(&target, &s.namespace)?;
            let mut args = ssh_args(&cli.global, &ssh, &remote)?;
            args.push(remote.host_with_user(ssh.username.as_deref()));
            args.extend(command);
            exec_local("ssh", &args)?;
        }
        Command::Scp {
            source,
            destination,
            ssh,
            recursive,
        } => {
            let args = scp_args(
                &cli.global,
                &s.namespace,
                &ssh,
                recursive,
                source,
                destination,
            )?;
            exec_local("scp", &args)?;
        }
        Command::PortForward {
            target,
            ports,
            stdio,
            address,
        } => port_forward(s, &target, &ports, stdio, address).await?,
        Command::Pause { kind, name } => pause(&s, &kind, &name, true).await?,
        Command::Unpause { kind, name } => pause(&s, &kind, &name, false).await?,
        Command::SoftReboot { name } => {
            s.vmi_verb(&name, "softreboot")
                .await
                .with_context(|| format!("Error soft rebooting VMI {name}"))?;
            println!("VMI {name} was scheduled to soft-reboot");
        }
        Command::Expand { vm, output } => expand(&s, &vm, &output).await?,
        Command::Guestosinfo { name } => print_query(&s, &name, "guestosinfo").await?,
        Command::Userlist { name } => print_query(&s, &name, "userlist").await?,
        Command::Fslist { name } => print_query(&s, &name, "filesystemlist").await?,
        Command::Vnc { name } => {
            // The server says why there is no display; nothing to connect to otherwise.
            s.vmi_get(&name, "vnc")
                .await
                .with_context(|| format!("Error connecting to VNC of {name}"))?;
        }
        Command::Version => version(&s).await?,
        Command::ImageUpload(args) => {
            let r = args.request(&s.namespace);
            virt_api::image_upload::image_upload(&s.client, &r).await?;
        }
    }
    Ok(())
}

/// pause / unpause of a VMI (a VM's is its VMI, which has its name).
async fn pause(s: &Subresources, kind: &str, name: &str, pause: bool) -> anyhow::Result<()> {
    let (verb, doing) = if pause {
        ("pause", "pausing")
    } else {
        ("unpause", "unpausing")
    };
    let what = kind_name(kind);
    s.vmi_verb(name, verb)
        .await
        .with_context(|| format!("Error {doing} {what} {name}"))?;
    println!("{what} {name} was scheduled to {verb}");
    Ok(())
}

/// A VM is paused through its VMI, which has its name.
fn kind_name(kind: &str) -> &'static str {
    if kind == "vm" {
        "VMI of VM"
    } else {
        "VMI"
    }
}

/// `[user@]TYPE/NAME[.NS]:PATH` split into the target and the path, when `spec` is one.
fn remote_spec(spec: &str) -> Option<(&str, &str)> {
    let (target, path) = spec.split_once(':')?;
    let host = target.rsplit_once('@').map_or(target, |(_, h)| h);
    let (kind, _) = host.split_once('/')?;
    [
        "vm",
        "vmi",
        "vms",
        "vmis",
        "virtualmachine",
        "virtualmachineinstance",
    ]
    .contains(&kind)
    .then_some((target, path))
}

/// An ssh target: `[user@]TYPE/NAME[.NAMESPACE]`.
struct SshTarget {
    user: Option<String>,
    kind: String,
    name: String,
    namespace: String,
}

impl SshTarget {
    fn parse(text: &str, default_namespace: &str) -> anyhow::Result<SshTarget> {
        let (user, rest) = match text.split_once('@') {
            Some((u, r)) => (Some(u.to_string()), r),
            None => (None, text),
        };
        let (resource, name, ns) = forward_target(rest)?;
        let kind = if resource == "virtualmachines" {
            "vm"
        } else {
            "vmi"
        };
        Ok(SshTarget {
            user,
            kind: kind.into(),
            name,
            namespace: ns.unwrap_or_else(|| default_namespace.to_string()),
        })
    }

    /// `TYPE/NAME.NAMESPACE`: what ssh knows the host as (its known_hosts entry), and what the
    /// ProxyCommand forwards to.
    fn host(&self) -> String {
        format!("{}/{}.{}", self.kind, self.name, self.namespace)
    }

    fn host_with_user(&self, user: Option<&str>) -> String {
        match user.or(self.user.as_deref()) {
            Some(u) => format!("{u}@{}", self.host()),
            None => self.host(),
        }
    }
}

/// The local ssh's options: this virtctl (with the same kubeconfig and context) as its
/// ProxyCommand, then the identity and the user's own options.
fn ssh_args(g: &Global, o: &SshOptions, target: &SshTarget) -> anyhow::Result<Vec<String>> {
    let me = std::env::current_exe().context("finding virtctl's own path for the ProxyCommand")?;
    let quote = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    let mut proxy = vec![quote(&me.to_string_lossy())];
    if let Some(k) = &g.kubeconfig {
        proxy.push(format!("--kubeconfig={}", quote(&k.to_string_lossy())));
    }
    if let Some(c) = &g.context {
        proxy.push(format!("--context={}", quote(c)));
    }
    proxy.extend([
        "port-forward".into(),
        "--stdio".into(),
        quote(&target.host()),
        o.port.to_string(),
    ]);
    let mut args = vec![
        "-o".to_string(),
        format!("ProxyCommand={}", proxy.join(" ")),
    ];
    if let Some(i) = &o.identity_file {
        args.push("-i".into());
        args.push(i.to_string_lossy().into_owned());
    }
    for opt in &o.local_ssh_opts {
        args.extend(opt.split_whitespace().map(str::to_string));
    }
    Ok(args)
}

/// Runs the local `program` with `args`, and ends with its exit status.
fn exec_local(program: &str, args: &[String]) -> anyhow::Result<()> {
    let status = std::process::Command::new(program)
        .args(args)
        .status()
        .with_context(|| format!("running the local {program} (is it installed?)"))?;
    std::process::exit(status.code().unwrap_or(1));
}

/// `TYPE/NAME[.NAMESPACE]` as KubeVirt's port-forward takes it: the resource and name, and
/// the namespace when given.
fn forward_target(target: &str) -> anyhow::Result<(&'static str, String, Option<String>)> {
    let (kind, rest) = target
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("{target:?}: give vm/NAME or vmi/NAME"))?;
    let resource = match kind {
        "vm" | "vms" | "virtualmachine" => "virtualmachines",
        "vmi" | "vmis" | "virtualmachineinstance" => "virtualmachineinstances",
        other => anyhow::bail!("{target:?}: {other:?} is not vm or vmi"),
    };
    Ok(match rest.split_once('.') {
        Some((name, ns)) => (resource, name.to_string(), Some(ns.to_string())),
        None => (resource, rest.to_string(), None),
    })
}

/// `LOCAL:REMOTE` or `PORT` (the same on both sides).
fn forward_ports(spec: &str) -> anyhow::Result<(u16, u16)> {
    let parse = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| anyhow::anyhow!("{spec:?}: ports are 1 to 65535 (LOCAL:REMOTE or PORT)"))
    };
    match spec.split_once(':') {
        // Local port 0: any free one (printed).
        Some(("0", r)) => Ok((0, parse(r)?)),
        Some((l, r)) => Ok((parse(l)?, parse(r)?)),
        None => {
            let p = parse(spec)?;
            Ok((p, p))
        }
    }
}

async fn port_forward(
    mut s: Subresources,
    target: &str,
    ports: &[String],
    stdio: bool,
    address: std::net::IpAddr,
) -> anyhow::Result<()> {
    let (resource, name, ns) = forward_target(target)?;
    if let Some(ns) = ns {
        s.namespace = ns;
    }
    let pairs = ports
        .iter()
        .map(|p| forward_ports(p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if stdio {
        let [(_, remote)] = pairs[..] else {
            anyhow::bail!("--stdio carries one connection: give one port");
        };
        let ws = s
            .port_forward(resource, &name, remote)
            .await
            .with_context(|| format!("Error forwarding to port {remote} of {target}"))?;
        relay(
            ws,
            tokio::io::stdin(),
            tokio::io::stdout(),
            AtEnd::AwaitPeer,
        )
        .await;
        return Ok(());
    }
    let s = std::sync::Arc::new(s);
    let mut listeners = Vec::new();
    for (local, remote) in pairs {
        let listener = tokio::net::TcpListener::bind((address, local))
            .await
            .with_context(|| format!("listening on {address}:{local}"))?;
        println!("Forwarding from {} -> {remote}", listener.local_addr()?);
        listeners.push((listener, remote));
    }
    let mut serving = tokio::task::JoinSet::new();
    for (listener, remote) in listeners {
        let s = s.clone();
        let name = name.clone();
        serving.spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let s = s.clone();
                let name = name.clone();
                tokio::spawn(async move {
                    match s.port_forward(resource, &name, remote).await {
                        Ok(ws) => {
                            let (r, w) = conn.into_split();
                            relay(ws, r, w, AtEnd::AwaitPeer).await;
                        }
                        Err(e) => eprintln!("Error forwarding to port {remote} of {name}: {e}"),
                    }
                });
            }
        });
    }
    while serving.join_next().await.is_some() {}
    Ok(())
}

/// The escape byte that leaves the console (Ctrl-]), as KubeVirt's virtctl has it.
const ESCAPE: u8 = 0x1d;

/// The terminal in raw mode while the console is open (keys go to the guest as typed),
/// restored however the session ends. Only when stdin is a terminal: piped input is passed as
/// it comes.
struct RawTerminal(bool);

impl RawTerminal {
    fn enter() -> RawTerminal {
        use std::io::IsTerminal;
        RawTerminal(
            std::io::stdin().is_terminal() && crossterm::terminal::enable_raw_mode().is_ok(),
        )
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if self.0 {
            let _ = crossterm::terminal::disable_raw_mode();
        }
    }
}

async fn console(s: &Subresources, name: &str) -> anyhow::Result<()> {
    use futures::{SinkExt, StreamExt};
    use std::io::{Read, Write};
    use tokio_tungstenite::tungstenite::Message;
    let ws = s
        .console(name)
        .await
        .with_context(|| format!("Error connecting to the console of {name}"))?;
    eprintln!("Successfully connected to {name} console. The escape sequence is ^]");
    let _raw = RawTerminal::enter();
    let (mut to_guest, mut from_guest) = ws.split();
    // stdin is read on a thread of its own (a blocking read); Ctrl-] or the end of input ends
    // the typing side.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        let mut buf = [0u8; 1024];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let chunk = &buf[..n];
                    let end = chunk.iter().position(|&b| b == ESCAPE);
                    let keys = chunk[..end.unwrap_or(n)].to_vec();
                    if !keys.is_empty() && tx.blocking_send(keys).is_err() {
                        return;
                    }
                    if end.is_some() {
                        let _ = tx.blocking_send(vec![ESCAPE]);
                        return;
                    }
                }
            }
        }
    });
    let typing = async {
        while let Some(keys) = rx.recv().await {
            if keys == [ESCAPE] {
                return;
            }
            if to_guest.send(Message::Binary(keys.into())).await.is_err() {
                return;
            }
        }
        // Input ended without the escape: keep showing the console until it closes.
        std::future::pending::<()>().await
    };
    let showing = async {
        let mut out = std::io::stdout();
        while let Some(Ok(m)) = from_guest.next().await {
            let bytes = match m {
                Message::Binary(b) => b.to_vec(),
                Message::Text(t) => t.as_bytes().to_vec(),
                Message::Close(_) => break,
                _ => continue,
            };
            let _ = out.write_all(&bytes);
            let _ = out.flush();
        }
    };
    tokio::select! {
        _ = typing => {}
        _ = showing => {}
    }
    Ok(())
}

async fn print_query(s: &Subresources, name: &str, sub: &str) -> anyhow::Result<()> {
    let v = s
        .vmi_get(name, sub)
        .await
        .with_context(|| format!("Error getting {sub} of {name}"))?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        // "Error starting VirtualMachine x: Operation cannot be fulfilled …", as KubeVirt's.
        eprintln!("{e:#}");
        std::process::exit(1);
    }
}
