//! A VM's NICs on its Pod's network, as KubeVirt's bindings define them, wired in one network
//! namespace with rtnetlink (links, addresses, routes) and nftables (NAT):
//!
//! - **masquerade** (KubeVirt's default for the pod network): a bridge `k6t-<pod iface>` with the
//!   gateway 10.0.2.1/24 (and fd10:0:2::1/120 when the Pod has IPv6), the guest's TAP on it, and
//!   NAT between the guest's 10.0.2.2 and the Pod's address;
//! - **bridge**: the Pod interface's address and MAC go to the guest; the interface itself is
//!   enslaved to the bridge next to the TAP (also how Multus secondary networks are attached).
//!
//! Each NIC gets a DHCP lease for the guest and a socket to serve it on (`dhcp`); the TAP and
//! that socket are file descriptors, which virt-handler hands to the launcher over its control
//! socket. The standalone launcher (`--network nat`) wires itself with the same code.
//!
//! Whatever was created is recorded, and undone by `PodNetwork::teardown` (or on drop) unless
//! the network was handed over with `PodNetwork::keep`.

pub mod antispoof;
pub mod dhcp;
pub mod nat;

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use api::protocol::DhcpLease;
use futures::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage, AddressScope};
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute};
use rtnetlink::{Handle, LinkBridge, LinkUnspec, RouteMessageBuilder};

pub use nat::{Port, Protocol};

/// KubeVirt's masquerade subnet.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);
pub const GUEST_V4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
pub const MASQUERADE_PREFIX_V4: u8 = 24;
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd10, 0, 2, 0, 0, 0, 0, 1);
pub const GUEST_V6: Ipv6Addr = Ipv6Addr::new(0xfd10, 0, 2, 0, 0, 0, 0, 2);
pub const MASQUERADE_PREFIX_V6: u8 = 120;
/// The masquerade gateway's (the bridge's) MAC, the same in every Pod.
pub const MASQUERADE_GATEWAY_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0];
/// The bridge binding's DHCP server address: link-local, so it takes nothing from the Pod's
/// subnet (KubeVirt uses the same kind of fake address).
pub const BRIDGE_DHCP_SERVER: Ipv4Addr = Ipv4Addr::new(169, 254, 75, 10);

/// How a NIC joins its network (`spec.domain.devices.interfaces[].masquerade` / `.bridge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    Masquerade,
    Bridge,
}

/// One NIC to wire.
#[derive(Clone, Debug)]
pub struct NicRequest {
    /// The VMI's interface name (for errors and the hand-over).
    pub interface: String,
    pub binding: Binding,
    /// The Pod interface behind it (`eth0`, or the interface Multus made); None only for a
    /// masquerade NIC of the standalone launcher, which NATs to whatever routes out.
    pub pod_interface: Option<String>,
    /// Masquerade: the ports forwarded to the guest (empty: all).
    pub ports: Vec<Port>,
    /// The MAC the guest's NIC has (`api::mac::of_interface`); a bridge binding gives the
    /// guest the Pod interface's instead. Frames from the TAP with another source are dropped
    /// (`antispoof`).
    pub guest_mac: [u8; 6],
}

/// How the links are named: inside a Pod's own namespace, KubeVirt's names; on a shared host
/// (the standalone launcher), names unique to this process.
#[derive(Clone, Debug)]
pub enum Naming {
    Pod,
    Unique(String),
}

#[derive(Clone, Debug)]
pub struct WireOptions {
    pub naming: Naming,
    /// Offered to the guest by DHCP.
    pub hostname: Option<String>,
    /// Where DNS servers and search domains for the guest come from (the Pod's resolv.conf).
    pub resolv_conf: PathBuf,
    /// TCP ports that stay with the Pod when a masquerade NIC forwards every port.
    pub excluded_tcp_ports: Vec<u16>,
}

impl Default for WireOptions {
    fn default() -> Self {
        WireOptions {
            naming: Naming::Pod,
            hostname: None,
            resolv_conf: "/etc/resolv.conf".into(),
            excluded_tcp_ports: Vec::new(),
        }
    }
}

/// What wiring a NIC produced.
#[derive(Debug)]
pub struct WiredNic {
    pub interface: String,
    pub tap_name: String,
    pub bridge: String,
    pub tap: OwnedFd,
    /// The MAC the guest must use (the request's, or with a bridge binding the Pod
    /// interface's): the only source the TAP lets out.
    pub mac: [u8; 6],
    /// None: nothing to offer (a secondary network without an address).
    pub lease: Option<DhcpLease>,
    pub dhcp_socket: Option<UdpSocket>,
    /// What the VMI's status reports for the NIC: the Pod's addresses.
    pub ip_addresses: Vec<String>,
    pub pod_interface: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("interface {interface}: {cause}")]
    Nic { interface: String, cause: String },
    #[error("network namespace {0}: {1}")]
    Netns(String, std::io::Error),
    #[error("netlink: {0}")]
    Netlink(String),
}

/// Something wiring made, to be undone.
#[derive(Debug)]
enum Made {
    Link(String),
    NatTable(String),
    /// The source guard on a TAP (`antispoof`).
    GuardTable(String),
    /// The bridge binding took the Pod interface's address, default route and MAC.
    PodInterface {
        name: String,
        mac: Vec<u8>,
        address: Option<(Ipv4Addr, u8)>,
        gateway: Option<Ipv4Addr>,
    },
}

/// The wired NICs of one VM, and how to undo them.
#[derive(Debug)]
pub struct PodNetwork {
    pub nics: Vec<WiredNic>,
    netns: Option<File>,
    made: Vec<Made>,
}

/// Runs `f` on a thread in the network namespace `netns` (None: this one). Sockets, links and
/// child processes made there belong to that namespace.
pub fn in_netns<T: Send>(netns: Option<&File>, f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(ns) = netns {
                // SAFETY: setns on this thread only, with a descriptor we hold open.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(f())
        })
        .join()
        .map_err(|_| std::io::Error::other("network wiring thread panicked"))?
    })
}

/// Opens the network namespace of process `pid` (what virt-handler does for a launcher, whose
/// PID it learns from the control socket's peer credentials).
pub fn netns_of(pid: u32) -> Result<File, WireError> {
    let p = format!("/proc/{pid}/ns/net");
    File::open(&p).map_err(|e| WireError::Netns(p, e))
}

/// Opens a named namespace (`ip netns add NAME`), or any namespace file.
pub fn netns_path(path: &Path) -> Result<File, WireError> {
    File::open(path).map_err(|e| WireError::Netns(path.display().to_string(), e))
}

/// Wires `nics` in `netns` (None: the caller's namespace). On any error, what was made for
/// every NIC is removed again and the error names the interface and the cause.
pub fn wire(
    netns: Option<File>,
    nics: &[NicRequest],
    options: &WireOptions,
) -> Result<PodNetwork, WireError> {
    let mut net = PodNetwork {
        nics: Vec::new(),
        netns: None,
        made: Vec::new(),
    };
    let result = in_netns(netns.as_ref(), || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| WireError::Netlink(e.to_string()))?;
        rt.block_on(async {
            let (conn, handle, _) =
                rtnetlink::new_connection().map_err(|e| WireError::Netlink(e.to_string()))?;
            tokio::spawn(conn);
            let dns = read_resolv_conf(&options.resolv_conf);
            for (i, req) in nics.iter().enumerate() {
                let nic = wire_nic(&handle, i, req, options, &dns, &mut net.made)
                    .await
                    .map_err(|cause| WireError::Nic {
                        interface: req.interface.clone(),
                        cause,
                    })?;
                net.nics.push(nic);
            }
            Ok::<(), WireError>(())
        })
    })
    .map_err(|e| WireError::Netns("of the Pod".into(), e))?;
    net.netns = netns;
    match result {
        Ok(()) => Ok(net),
        Err(e) => {
            net.teardown();
            Err(e)
        }
    }
}

impl PodNetwork {
    /// The network now belongs to the VM (the launcher holds the TAPs and sockets): nothing is
    /// undone when this value goes away; the links go with the Pod's namespace.
    pub fn keep(mut self) {
        self.made.clear();
    }

    /// Removes what wiring made, newest first, and gives the Pod interface back what the
    /// bridge binding took from it.
    pub fn teardown(&mut self) {
        let made = std::mem::take(&mut self.made);
        self.nics.clear();
        if made.is_empty() {
            return;
        }
        let r = in_netns(self.netns.as_ref(), || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let (conn, handle, _) = rtnetlink::new_connection().ok()?;
                tokio::spawn(conn);
                for m in made.into_iter().rev() {
                    if let Err(e) = undo(&handle, &m).await {
                        tracing::warn!(?m, "undoing network wiring: {e}");
                    }
                }
                Some(())
            })
        });
        if let Err(e) = r {
            tracing::warn!("undoing network wiring: {e}");
        }
    }
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn nl(what: &str) -> impl Fn(rtnetlink::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

async fn undo(handle: &Handle, m: &Made) -> Result<(), String> {
    match m {
        Made::Link(name) => {
            if let Some(l) = link(handle, name).await? {
                handle
                    .link()
                    .del(l.header.index)
                    .execute()
                    .await
                    .map_err(nl(name))?;
            }
        }
        Made::NatTable(t) => nat::remove(t),
        Made::GuardTable(t) => antispoof::remove(t),
        Made::PodInterface {
            name,
            mac,
            address,
            gateway,
        } => {
            let l = link(handle, name).await?.ok_or(format!("{name} is gone"))?;
            let idx = l.header.index;
            set_link(
                handle,
                LinkUnspec::new_with_index(idx)
                    .nocontroller()
                    .down()
                    .build(),
                name,
            )
            .await?;
            set_link(
                handle,
                LinkUnspec::new_with_index(idx)
                    .address(mac.clone())
                    .up()
                    .build(),
                name,
            )
            .await?;
            if let Some((a, p)) = address {
                handle
                    .address()
                    .add(idx, IpAddr::V4(*a), *p)
                    .replace()
                    .execute()
                    .await
                    .map_err(nl(name))?;
            }
            if let Some(gw) = gateway {
                let r = RouteMessageBuilder::<Ipv4Addr>::new()
                    .gateway(*gw)
                    .output_interface(idx)
                    .build();
                let _ = handle.route().add(r).execute().await;
            }
        }
    }
    Ok(())
}

async fn link(handle: &Handle, name: &str) -> Result<Option<LinkMessage>, String> {
    match handle
        .link()
        .get()
        .match_name(name.to_string())
        .execute()
        .try_next()
        .await
    {
        Ok(l) => Ok(l),
        // ENODEV: there is no such link.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(e) => Err(format!("looking up {name}: {e}")),
    }
}

async fn set_link(handle: &Handle, msg: LinkMessage, what: &str) -> Result<(), String> {
    handle.link().set(msg).execute().await.map_err(nl(what))
}

fn link_mac(l: &LinkMessage) -> Option<Vec<u8>> {
    l.attributes.iter().find_map(|a| match a {
        LinkAttribute::Address(m) => Some(m.clone()),
        _ => None,
    })
}

fn link_mtu(l: &LinkMessage) -> Option<u32> {
    l.attributes.iter().find_map(|a| match a {
        LinkAttribute::Mtu(m) => Some(*m),
        _ => None,
    })
}

/// The global-scope addresses of link `index`.
async fn addresses(handle: &Handle, index: u32) -> Result<Vec<(AddressMessage, IpAddr)>, String> {
    let mut out = Vec::new();
    let mut s = handle
        .address()
        .get()
        .set_link_index_filter(index)
        .execute();
    while let Some(m) = s.try_next().await.map_err(nl("listing addresses"))? {
        if m.header.index != index || m.header.scope != AddressScope::Universe {
            continue;
        }
        let a = m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(a) => Some(*a),
            _ => None,
        });
        if let Some(a) = a {
            out.push((m, a));
        }
    }
    Ok(out)
}

/// The IPv4 default gateway through link `index`.
async fn default_gateway(handle: &Handle, index: u32) -> Result<Option<Ipv4Addr>, String> {
    let mut s = handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute();
    while let Some(r) = s.try_next().await.map_err(nl("listing routes"))? {
        if r.header.destination_prefix_length != 0 {
            continue;
        }
        let oif = r
            .attributes
            .iter()
            .any(|a| matches!(a, RouteAttribute::Oif(i) if *i == index));
        let gw = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Gateway(RouteAddress::Inet(g)) => Some(*g),
            _ => None,
        });
        if oif && gw.is_some() {
            return Ok(gw);
        }
    }
    Ok(None)
}

/// Creates a TAP with a virtio-net header that lives as long as the returned descriptor. By
/// hand: it is one ioctl, and the crates that wrap TUN devices bring an async runtime and I/O
/// layer the VMM has no use for (the VMM does its own I/O on the descriptor).
pub fn create_tap(name: &str) -> Result<OwnedFd, String> {
    const IFF_TAP: libc::c_short = 0x0002;
    const IFF_NO_PI: libc::c_short = 0x1000;
    const IFF_VNET_HDR: libc::c_short = 0x4000;
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(format!("TAP name {name:?}: 1 to 15 characters"));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|e| format!("/dev/net/tun: {e}"))?;
    // SAFETY: an ifreq is plain data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
    // SAFETY: TUNSETIFF reads the ifreq we own.
    if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
        return Err(format!("TAP {name}: {}", std::io::Error::last_os_error()));
    }
    Ok(file.into())
}

/// DNS servers (IPv4, for DHCPv4) and search domains of a resolv.conf; a missing file gives
/// none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResolvConf {
    pub servers: Vec<Ipv4Addr>,
    pub search: Vec<String>,
}

pub fn parse_resolv_conf(text: &str) -> ResolvConf {
    let mut r = ResolvConf::default();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(Ok(a)) = words.next().map(str::parse::<Ipv4Addr>) {
                    r.servers.push(a);
                }
            }
            // The last search (or domain) line wins, as in the resolver.
            Some("search") => r.search = words.map(String::from).collect(),
            Some("domain") => r.search = words.take(1).map(String::from).collect(),
            _ => {}
        }
    }
    r
}

fn read_resolv_conf(path: &Path) -> ResolvConf {
    std::fs::read_to_string(path)
        .map(|t| parse_resolv_conf(&t))
        .unwrap_or_default()
}

fn sysctl(path: &str, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("{path}: {e}"))
}

/// A locally administered MAC derived from `mac` for the Pod interface whose own MAC the guest
/// takes over (the bridge would otherwise keep frames for it).
fn displaced_mac(mac: &[u8]) -> Vec<u8> {
    let mut m = mac.to_vec();
    if let Some(first) = m.first_mut() {
        *first = (*first | 0x02) & !0x01;
    }
    if let Some(last) = m.last_mut() {
        *last ^= 0x5a;
    }
    m
}

/// The names of one NIC's links and tables in the Pod.
struct NicNames {
    bridge: String,
    tap: String,
    /// The masquerade NAT table.
    nat: String,
    /// The source guard's table.
    guard: String,
}

impl NicNames {
    fn of(naming: &Naming, i: usize, req: &NicRequest) -> Result<NicNames, String> {
        let names = match naming {
            Naming::Pod => {
                let base = req
                    .pod_interface
                    .clone()
                    .unwrap_or_else(|| format!("eth{i}"));
                NicNames {
                    bridge: format!("k6t-{base}"),
                    tap: format!("tap{i}"),
                    nat: format!("microvirt-{base}"),
                    guard: format!("{}{}", antispoof::TABLE_PREFIX, req.interface),
                }
            }
            Naming::Unique(tag) => NicNames {
                bridge: format!("mvbr{tag}{i}"),
                tap: format!("mvtap{tag}{i}"),
                nat: format!("microvirt-{tag}{i}"),
                guard: format!("{}{tag}{i}", antispoof::TABLE_PREFIX),
            },
        };
        if names.bridge.len() >= libc::IFNAMSIZ {
            return Err(format!(
                "bridge name {} is longer than 15 characters (the Pod interface name is too long)",
                names.bridge
            ));
        }
        Ok(names)
    }
}

/// What the guest is given on its side of the bridge.
struct GuestSide {
    mac: [u8; 6],
    lease: Option<DhcpLease>,
    v6: Option<Ipv6Addr>,
    /// What the VMI's status reports for the interface.
    ip_addresses: Vec<String>,
}

/// One NIC being wired: the Pod's interface (if any) and its addresses, the bridge made for
/// the guest, and everything made so far (undone by the caller if a step fails).
struct NicWiring<'a> {
    handle: &'a Handle,
    req: &'a NicRequest,
    options: &'a WireOptions,
    dns: &'a ResolvConf,
    made: &'a mut Vec<Made>,
    names: NicNames,
    pod: Option<LinkMessage>,
    pod_addrs: Vec<(AddressMessage, IpAddr)>,
    mtu: u32,
    /// The bridge's link index.
    br: u32,
}

async fn wire_nic(
    handle: &Handle,
    i: usize,
    req: &NicRequest,
    options: &WireOptions,
    dns: &ResolvConf,
    made: &mut Vec<Made>,
) -> Result<WiredNic, String> {
    let names = NicNames::of(&options.naming, i, req)?;
    let pod = match &req.pod_interface {
        Some(p) => Some(link(handle, p).await?.ok_or_else(|| {
            format!("the Pod has no interface {p} (for Multus networks: did Multus attach it?)")
        })?),
        None => None,
    };
    if req.binding == Binding::Bridge && pod.is_none() {
        return Err("a bridge binding needs a Pod interface".into());
    }
    if link(handle, &names.bridge).await?.is_some() {
        return Err(format!("{} already exists in the Pod", names.bridge));
    }
    let pod_addrs = match &pod {
        Some(l) => addresses(handle, l.header.index).await?,
        None => Vec::new(),
    };
    let mut w = NicWiring {
        handle,
        req,
        options,
        dns,
        made,
        mtu: pod.as_ref().and_then(link_mtu).unwrap_or(1500),
        names,
        pod,
        pod_addrs,
        br: 0,
    };
    w.create_bridge().await?;
    let guest = match req.binding {
        Binding::Masquerade => w.masquerade().await?,
        Binding::Bridge => w.bridge_pod_interface().await?,
    };
    let tap = w.attach_tap(&guest).await?;
    let bridge = w.names.bridge;
    let dhcp_socket = match &guest.lease {
        Some(_) => Some(
            dhcp::server_socket(&bridge).map_err(|e| format!("DHCP socket on {bridge}: {e}"))?,
        ),
        None => None,
    };
    Ok(WiredNic {
        interface: req.interface.clone(),
        tap_name: w.names.tap,
        bridge,
        tap,
        mac: guest.mac,
        lease: guest.lease,
        dhcp_socket,
        ip_addresses: guest.ip_addresses,
        pod_interface: req.pod_interface.clone(),
    })
}

impl NicWiring<'_> {
    fn lease(
        &self,
        address: Ipv4Addr,
        prefix_len: u8,
        router: Option<Ipv4Addr>,
        server: Ipv4Addr,
    ) -> DhcpLease {
        DhcpLease {
            address,
            prefix_len,
            router,
            server,
            dns: self.dns.servers.clone(),
            search: self.dns.search.clone(),
            mtu: u16::try_from(self.mtu).ok(),
            hostname: self.options.hostname.clone(),
        }
    }

    async fn create_bridge(&mut self) -> Result<(), String> {
        let bridge = &self.names.bridge;
        let mut bridge_link = LinkBridge::new(bridge).mtu(self.mtu);
        if self.req.binding == Binding::Masquerade {
            // The guest's gateway has the same MAC in every Pod, so after a live migration the
            // guest's ARP entry for it is still right (KubeVirt fixes it the same way).
            bridge_link = bridge_link.address(MASQUERADE_GATEWAY_MAC.to_vec());
        }
        self.handle
            .link()
            .add(bridge_link.build())
            .execute()
            .await
            .map_err(nl(&format!("creating bridge {bridge}")))?;
        self.made.push(Made::Link(bridge.clone()));
        self.br = link(self.handle, bridge)
            .await?
            .ok_or(format!("{bridge} vanished"))?
            .header
            .index;
        Ok(())
    }

    /// Masquerade: the guest gets 10.0.2.2 (and fd10:0:2::2 when the Pod has IPv6) behind a
    /// gateway on the bridge, and the Pod NATs its traffic.
    async fn masquerade(&mut self) -> Result<GuestSide, String> {
        let (handle, br, bridge) = (self.handle, self.br, self.names.bridge.clone());
        // The guest's side must not overlap the Pod's own network, or replies to the guest
        // would be routed out of the Pod instead.
        if let Some((_, a)) = self.pod_addrs.iter().find(|(m, a)| match a {
            IpAddr::V4(v4) => {
                let p = m.header.prefix_len.min(MASQUERADE_PREFIX_V4);
                let mask = dhcp::netmask(p);
                u32::from(*v4) & u32::from(mask) == u32::from(GATEWAY_V4) & u32::from(mask)
            }
            IpAddr::V6(_) => false,
        }) {
            return Err(format!(
                "the Pod's address {a} overlaps the masquerade network 10.0.2.0/24 the guest is given"
            ));
        }
        let has_v6 = self.pod_addrs.iter().any(|(_, a)| a.is_ipv6());
        handle
            .address()
            .add(br, IpAddr::V4(GATEWAY_V4), MASQUERADE_PREFIX_V4)
            .execute()
            .await
            .map_err(|e| format!("gateway {GATEWAY_V4}/24 on {bridge}: {e} (does the Pod's network overlap 10.0.2.0/24?)"))?;
        if has_v6 {
            handle
                .address()
                .add(br, IpAddr::V6(GATEWAY_V6), MASQUERADE_PREFIX_V6)
                .execute()
                .await
                .map_err(nl(&format!("gateway {GATEWAY_V6} on {bridge}")))?;
        }
        sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
        if has_v6 {
            sysctl("/proc/sys/net/ipv6/conf/all/forwarding", "1")?;
        }
        let n = nat::MasqueradeNat {
            table: self.names.nat.clone(),
            bridge,
            guest_v4: GUEST_V4,
            guest_v6: has_v6.then_some(GUEST_V6),
            pod_interface: self.req.pod_interface.clone(),
            ports: self.req.ports.clone(),
            excluded_tcp_ports: self.options.excluded_tcp_ports.clone(),
        };
        self.made.push(Made::NatTable(self.names.nat.clone()));
        n.apply()?;
        let ip_addresses = if self.pod.is_none() {
            vec![GUEST_V4.to_string()]
        } else {
            self.pod_addrs.iter().map(|(_, a)| a.to_string()).collect()
        };
        Ok(GuestSide {
            mac: self.req.guest_mac,
            lease: Some(self.lease(GUEST_V4, MASQUERADE_PREFIX_V4, Some(GATEWAY_V4), GATEWAY_V4)),
            v6: has_v6.then_some(GUEST_V6),
            ip_addresses,
        })
    }

    /// Bridge: the Pod interface joins the bridge under a displaced MAC and hands the guest
    /// its MAC, its address (by DHCP) and its default gateway.
    async fn bridge_pod_interface(&mut self) -> Result<GuestSide, String> {
        let handle = self.handle;
        let pod = self.pod.as_ref().expect("checked by wire_nic");
        let name = self.req.pod_interface.clone().unwrap_or_default();
        let idx = pod.header.index;
        let pod_mac = link_mac(pod).ok_or(format!("{name} has no MAC address"))?;
        let v4 = self.pod_addrs.iter().find_map(|(m, a)| match a {
            IpAddr::V4(a) => Some((m.clone(), *a, m.header.prefix_len)),
            _ => None,
        });
        let gateway = default_gateway(handle, idx).await?;
        self.made.push(Made::PodInterface {
            name: name.clone(),
            mac: pod_mac.clone(),
            address: v4.as_ref().map(|(_, a, p)| (*a, *p)),
            gateway,
        });
        if let Some((m, _, _)) = &v4 {
            handle
                .address()
                .del(m.clone())
                .execute()
                .await
                .map_err(nl(&format!("taking the address off {name}")))?;
        }
        set_link(
            handle,
            LinkUnspec::new_with_index(idx).down().build(),
            &name,
        )
        .await?;
        set_link(
            handle,
            LinkUnspec::new_with_index(idx)
                .address(displaced_mac(&pod_mac))
                .controller(self.br)
                .up()
                .build(),
            &name,
        )
        .await?;
        let mut lease = None;
        if let Some((_, a, p)) = v4 {
            let bridge = &self.names.bridge;
            handle
                .address()
                .add(self.br, IpAddr::V4(BRIDGE_DHCP_SERVER), 32)
                .execute()
                .await
                .map_err(nl(&format!("DHCP server address on {bridge}")))?;
            lease = Some(self.lease(a, p, gateway, BRIDGE_DHCP_SERVER));
        }
        let mac = <[u8; 6]>::try_from(pod_mac.as_slice())
            .map_err(|_| format!("{name}'s MAC {pod_mac:02x?} is not six bytes"))?;
        let v6 = self.pod_addrs.iter().find_map(|(_, a)| match a {
            IpAddr::V6(a) => Some(*a),
            _ => None,
        });
        Ok(GuestSide {
            mac,
            lease,
            v6,
            ip_addresses: self.pod_addrs.iter().map(|(_, a)| a.to_string()).collect(),
        })
    }

    /// The guest's TAP: guarded, then on the bridge and up (and the bridge up).
    async fn attach_tap(&mut self, guest: &GuestSide) -> Result<OwnedFd, String> {
        let (handle, tap_name) = (self.handle, self.names.tap.clone());
        let tap = create_tap(&tap_name)?;
        self.made.push(Made::Link(tap_name.clone()));
        let t = link(handle, &tap_name)
            .await?
            .ok_or(format!("{tap_name} vanished"))?
            .header
            .index;
        // The guard is in place before the TAP joins the bridge and comes up: no frame of the
        // guest's reaches the Pod's network unchecked.
        self.made.push(Made::GuardTable(self.names.guard.clone()));
        antispoof::GuestSource {
            table: self.names.guard.clone(),
            tap: tap_name.clone(),
            mac: guest.mac,
            v4: guest.lease.as_ref().map(|l| l.address),
            v6: guest.v6,
        }
        .apply()?;
        set_link(
            handle,
            LinkUnspec::new_with_index(t)
                .mtu(self.mtu)
                .controller(self.br)
                .up()
                .build(),
            &tap_name,
        )
        .await?;
        let bridge = &self.names.bridge;
        set_link(
            handle,
            LinkUnspec::new_with_index(self.br).up().build(),
            bridge,
        )
        .await?;
        Ok(tap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_of_a_pod() {
        let r = parse_resolv_conf(
            "search default.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.96.0.10\nnameserver fd00::10\noptions ndots:5\n",
        );
        assert_eq!(r.servers, vec![Ipv4Addr::new(10, 96, 0, 10)]);
        assert_eq!(r.search.len(), 3);
        assert_eq!(parse_resolv_conf(""), ResolvConf::default());
    }

    #[test]
    fn a_displaced_mac_is_local_unicast_and_differs() {
        let m = displaced_mac(&[0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x05]);
        assert_ne!(m, vec![0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x05]);
        assert_eq!(m[0] & 0x03, 0x02);
    }
}
