//! Standalone networking for a `pod` network: in the current network namespace, a bridge with
//! the gateway address, one TAP per interface on it, and NAT from the guest subnet, as KubeVirt's
//! masquerade binding gives a guest 10.0.2.2/24 behind 10.0.2.1. The guest kernel gets its
//! address through the `ip=` boot parameter (KubeVirt's launcher runs a DHCP server instead;
//! that arrives with virt-handler).
//!
//! Links and addresses are made with iproute2 and NAT with nftables, the tools every node has;
//! the TAP itself is created with `Tap::create` and handed to the VM as a file descriptor, so it
//! disappears with the VM. `Drop` removes the bridge and the NAT table.

use std::os::fd::IntoRawFd;
use std::process::Command;

use vmm::config::{NetConfig, TapSource};
use vmm::devices::virtio::net::Tap;

use crate::translate::NicPlan;

pub const GATEWAY: &str = "10.0.2.1";
pub const GUEST: &str = "10.0.2.2";
pub const SUBNET: &str = "10.0.2.0/24";

pub struct PodNetwork {
    bridge: String,
    table: String,
}

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| {
        format!("{cmd}: {e} (install iproute2 and nftables, or use --network none)")
    })?;
    if !out.status.success() {
        return Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// A short, stable tag for interface names (IFNAMSIZ is 16).
fn tag(name: &str) -> String {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!("{:08x}", (h ^ std::process::id() as u64) as u32)
}

impl PodNetwork {
    /// Wires the masquerade/bridge NICs of a pod network. Returns the network (torn down on
    /// drop), the NIC configs for the VM, and the kernel parameter that configures the guest.
    pub fn setup(
        vm: &str,
        nics: &[NicPlan],
    ) -> Result<(PodNetwork, Vec<NetConfig>, String), String> {
        if let Some(n) = nics.iter().find(|n| n.multus.is_some()) {
            return Err(format!(
                "interface {}: Multus networks need a cluster; use --network none",
                n.interface
            ));
        }
        if nics.len() > 1 {
            return Err("one pod network interface is supported in standalone mode".into());
        }
        let t = tag(vm);
        let net = PodNetwork {
            bridge: format!("mvbr{t}"),
            table: format!("microvirt_{t}"),
        };
        run("ip", &["link", "add", &net.bridge, "type", "bridge"])?;
        run(
            "ip",
            &["addr", "add", &format!("{GATEWAY}/24"), "dev", &net.bridge],
        )?;
        run("ip", &["link", "set", &net.bridge, "up"])?;
        let mut configs = Vec::new();
        for (i, nic) in nics.iter().enumerate() {
            let tap = format!("mvtap{t}{i}");
            let fd = Tap::create(&tap).map_err(|e| e.to_string())?;
            run("ip", &["link", "set", &tap, "master", &net.bridge])?;
            run("ip", &["link", "set", &tap, "up"])?;
            configs.push(NetConfig {
                tap: TapSource::Fd(fd.into_raw_fd()),
                mac: nic.mac,
            });
        }
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(|e| format!("enabling IPv4 forwarding: {e}"))?;
        let ruleset = format!(
            "table ip {table} {{\n  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    ip saddr {SUBNET} oifname != \"{bridge}\" masquerade\n  }}\n}}\n",
            table = net.table,
            bridge = net.bridge
        );
        let mut child = Command::new("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("nft: {e} (install nftables, or use --network none)"))?;
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), ruleset.as_bytes())
            .map_err(|e| format!("nft: {e}"))?;
        let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "nft: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let ip = format!("ip={GUEST}::{GATEWAY}:255.255.255.0:{vm}:eth0:off");
        Ok((net, configs, ip))
    }

    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    pub fn nat_table(&self) -> &str {
        &self.table
    }
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        let _ = run("nft", &["delete", "table", "ip", &self.table]);
        let _ = run("ip", &["link", "del", &self.bridge]);
    }
}
