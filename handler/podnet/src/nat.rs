//! The masquerade binding's NAT, as KubeVirt programs it in the launcher Pod: the guest's
//! traffic leaves with the Pod's address (masquerade), and traffic that reaches the Pod is
//! handed to the guest (DNAT) — the interface's `ports`, or every port but the migration
//! listener's, which must keep reaching the launcher. One table per NIC, both families when the
//! Pod has IPv6, replaced or removed as a whole.

use std::borrow::Cow;
use std::net::{Ipv4Addr, Ipv6Addr};

use nftables::batch::Batch;
use nftables::expr::{Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, SetItem};
use nftables::schema::{Chain, NfListObject, Nftables, Rule, Table};
use nftables::stmt::{Match, Operator, Return, Statement, NAT};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};

/// A transport protocol of a forwarded port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// One of `spec.domain.devices.interfaces[].ports`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Port {
    pub protocol: Protocol,
    pub port: u16,
}

/// What one masquerade NIC's table says.
#[derive(Clone, Debug)]
pub struct MasqueradeNat {
    pub table: String,
    /// The guest side: traffic towards it is not masqueraded.
    pub bridge: String,
    pub guest_v4: Ipv4Addr,
    pub guest_v6: Option<Ipv6Addr>,
    /// The Pod's interface inbound traffic arrives on; None: no inbound forwarding (the
    /// standalone launcher on a host's own network).
    pub pod_interface: Option<String>,
    /// Ports to forward; empty: all.
    pub ports: Vec<Port>,
    /// TCP ports that stay with the Pod when all are forwarded (the migration listener).
    pub excluded_tcp_ports: Vec<u16>,
}

fn field(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: field.into(),
        },
    )))
}

fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn matches(
    left: Expression<'static>,
    op: Operator,
    right: Expression<'static>,
) -> Statement<'static> {
    Statement::Match(Match { left, right, op })
}

fn text(s: impl Into<String>) -> Expression<'static> {
    Expression::String(Cow::Owned(s.into()))
}

impl MasqueradeNat {
    fn family_rules(&self, family: NfFamily, guest: String) -> Vec<NfListObject<'static>> {
        let ip = if family == NfFamily::IP { "ip" } else { "ip6" };
        let table: Cow<'static, str> = self.table.clone().into();
        let chain = |name: &'static str, hook: NfHook, prio: i32| {
            NfListObject::Chain(Chain {
                family,
                table: table.clone(),
                name: name.into(),
                _type: Some(NfChainType::NAT),
                hook: Some(hook),
                prio: Some(prio),
                policy: Some(NfChainPolicy::Accept),
                ..Default::default()
            })
        };
        let rule = |chain: &'static str, expr: Vec<Statement<'static>>| {
            NfListObject::Rule(Rule {
                family,
                table: table.clone(),
                chain: chain.into(),
                expr: expr.into(),
                ..Default::default()
            })
        };
        let dnat = || {
            Statement::DNAT(Some(NAT {
                addr: Some(text(guest.clone())),
                family: None,
                port: None,
                flags: None,
            }))
        };
        let mut out = vec![
            NfListObject::Table(Table {
                family,
                name: table.clone(),
                handle: None,
            }),
            // dstnat / srcnat priorities, as `nft` spells them.
            chain("prerouting", NfHook::Prerouting, -100),
            chain("postrouting", NfHook::Postrouting, 100),
            rule(
                "postrouting",
                vec![
                    matches(field(ip, "saddr"), Operator::EQ, text(guest.clone())),
                    matches(
                        meta(MetaKey::Oifname),
                        Operator::NEQ,
                        text(self.bridge.clone()),
                    ),
                    Statement::Masquerade(None),
                ],
            ),
        ];
        if let Some(pod) = &self.pod_interface {
            let inbound = || matches(meta(MetaKey::Iifname), Operator::EQ, text(pod.clone()));
            if self.ports.is_empty() {
                if !self.excluded_tcp_ports.is_empty() {
                    let set = self
                        .excluded_tcp_ports
                        .iter()
                        .map(|&p| SetItem::Element(Expression::Number(p as u32)))
                        .collect();
                    out.push(rule(
                        "prerouting",
                        vec![
                            inbound(),
                            matches(
                                field("tcp", "dport"),
                                Operator::EQ,
                                Expression::Named(NamedExpression::Set(set)),
                            ),
                            Statement::Return(Some(Return {})),
                        ],
                    ));
                }
                out.push(rule("prerouting", vec![inbound(), dnat()]));
            } else {
                for p in &self.ports {
                    out.push(rule(
                        "prerouting",
                        vec![
                            inbound(),
                            matches(
                                field(p.protocol.name(), "dport"),
                                Operator::EQ,
                                Expression::Number(p.port as u32),
                            ),
                            dnat(),
                        ],
                    ));
                }
            }
        }
        out
    }

    /// The whole ruleset: the table(s) flushed and rebuilt in one transaction.
    pub fn ruleset(&self) -> Nftables<'static> {
        let mut batch = Batch::new();
        let mut families = vec![(NfFamily::IP, self.guest_v4.to_string())];
        if let Some(v6) = self.guest_v6 {
            families.push((NfFamily::IP6, v6.to_string()));
        }
        for (family, guest) in families {
            // add + delete + add: the table is replaced whether or not it existed.
            let t = NfListObject::Table(Table {
                family,
                name: self.table.clone().into(),
                handle: None,
            });
            batch.add(t.clone());
            batch.delete(t);
            for o in self.family_rules(family, guest) {
                batch.add(o);
            }
        }
        batch.to_nftables()
    }

    /// Programs the table (replacing an older one of the same name).
    pub fn apply(&self) -> Result<(), String> {
        nftables::helper::apply_ruleset(&self.ruleset()).map_err(|e| format!("nftables: {e}"))
    }
}

/// Removes the NIC's table(s); a table that is not there is not an error.
///
/// Over netlink rather than through `nft`: a standalone `virt-launcher run` undoes its NAT
/// after its control seccomp filter is in place, and that filter lets no thread start a
/// program. (Programming the table stays with `nft -j`, above.)
pub fn remove(table: &str) {
    for family in [libc::NFPROTO_IPV4, libc::NFPROTO_IPV6] {
        remove_family(family as u8, table);
    }
}

/// Removes table `table` of nf_tables family `family` (an `NFPROTO_*`), if it is there.
pub(crate) fn remove_family(family: u8, table: &str) {
    match delete_table(family, table) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) => tracing::warn!(table, family, "removing nftables table: {e}"),
    }
}

// nfnetlink message numbers (<linux/netfilter/nfnetlink.h>, <linux/netfilter/nf_tables.h>).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_DELTABLE: u16 = 2;
const NFTA_TABLE_NAME: u16 = 1;

/// One netlink message: header, nfgenmsg (`family`, version 0, `res_id` big-endian) and
/// `attrs` (already padded), appended to `out`.
fn nfnl_message(
    out: &mut Vec<u8>,
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: &[u8],
) {
    let len = 16 + 4 + attrs.len();
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes()); // the kernel fills in our port
    out.push(family);
    out.push(0); // NFNETLINK_V0
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(attrs);
}

/// The batch that deletes table `name` of `family`: begin, NFT_MSG_DELTABLE (acknowledged),
/// end. nf_tables takes changes only in batches.
fn delete_table_batch(family: u8, name: &str, seq: u32) -> Vec<u8> {
    let mut attr = Vec::new();
    let value_len = name.len() + 1; // NUL-terminated
    attr.extend_from_slice(&((4 + value_len) as u16).to_ne_bytes());
    attr.extend_from_slice(&NFTA_TABLE_NAME.to_ne_bytes());
    attr.extend_from_slice(name.as_bytes());
    attr.push(0);
    while attr.len() % 4 != 0 {
        attr.push(0);
    }
    let request = libc::NLM_F_REQUEST as u16;
    let mut b = Vec::new();
    nfnl_message(
        &mut b,
        NFNL_MSG_BATCH_BEGIN,
        request,
        seq,
        libc::AF_UNSPEC as u8,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    nfnl_message(
        &mut b,
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE,
        request | libc::NLM_F_ACK as u16,
        seq + 1,
        family,
        0,
        &attr,
    );
    nfnl_message(
        &mut b,
        NFNL_MSG_BATCH_END,
        request,
        seq + 2,
        libc::AF_UNSPEC as u8,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    b
}

/// Deletes nf_tables table `name` of `family` in this network namespace and waits for the
/// kernel's answer: Ok, or the errno it gave (ENOENT: no such table).
fn delete_table(family: u8, name: &str) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    if name.is_empty() || name.len() > 255 || name.contains('\0') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "bad table name",
        ));
    }
    // SAFETY: a plain socket call; the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socket returned a new descriptor we now own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: 5,
        tv_usec: 0,
    };
    // SAFETY: setsockopt reads a timeval of the size given.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    let seq = std::process::id().wrapping_mul(4);
    let batch = delete_table_batch(family, name, seq);
    // SAFETY: sockaddr_nl is plain data; zeroed is the kernel as destination.
    let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    to.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: sendto reads `batch` and `to` of the sizes given.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            batch.as_ptr().cast(),
            batch.len(),
            0,
            (&to as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = [0u8; 8192];
    loop {
        // SAFETY: recv writes at most buf.len() bytes into buf.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if let Some(answer) = ack_for(&buf[..n as usize], seq + 1) {
            return answer;
        }
    }
}

/// The kernel's answer to message `seq` in `msgs`, if it is there: NLMSG_ERROR with error 0
/// is success, any other error its errno. Every length is checked against the buffer.
fn ack_for(mut msgs: &[u8], seq: u32) -> Option<std::io::Result<()>> {
    while msgs.len() >= 16 {
        let len = u32::from_ne_bytes(msgs[0..4].try_into().ok()?) as usize;
        if len < 16 || len > msgs.len() {
            return None;
        }
        let kind = u16::from_ne_bytes(msgs[4..6].try_into().ok()?);
        let this_seq = u32::from_ne_bytes(msgs[8..12].try_into().ok()?);
        if kind == libc::NLMSG_ERROR as u16 && this_seq == seq && len >= 20 {
            let errno = i32::from_ne_bytes(msgs[16..20].try_into().ok()?);
            return Some(if errno == 0 {
                Ok(())
            } else {
                Err(std::io::Error::from_raw_os_error(-errno))
            });
        }
        msgs = &msgs[((len + 3) & !3).min(msgs.len())..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The delete batch is what nfnetlink expects, and answers are read with every length
    /// checked: short, overlong and foreign messages are no answer.
    #[test]
    fn delete_batch_and_answers() {
        let b = delete_table_batch(libc::NFPROTO_IPV4 as u8, "microvirt-eth0", 40);
        // begin (20) + deltable (20 + 4 + 15 padded to 16) + end (20)
        assert_eq!(b.len(), 20 + 40 + 20);
        assert_eq!(u16::from_ne_bytes([b[24], b[25]]), (10 << 8) | 2);
        assert_eq!(&b[44..58], b"microvirt-eth0");
        let ack = |seq: u32, errno: i32| {
            let mut m = Vec::new();
            m.extend_from_slice(&36u32.to_ne_bytes());
            m.extend_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
            m.extend_from_slice(&0u16.to_ne_bytes());
            m.extend_from_slice(&seq.to_ne_bytes());
            m.extend_from_slice(&0u32.to_ne_bytes());
            m.extend_from_slice(&errno.to_ne_bytes());
            m.extend_from_slice(&[0u8; 16]);
            m
        };
        assert!(ack_for(&ack(41, 0), 41).unwrap().is_ok());
        let e = ack_for(&ack(41, -libc::ENOENT), 41).unwrap().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        assert!(ack_for(&ack(7, 0), 41).is_none());
        let mut long = ack(41, 0);
        long[0] = 200;
        assert!(ack_for(&long, 41).is_none());
        assert!(ack_for(&long[..10], 41).is_none());
        let mut two = ack(7, 0);
        two.extend(ack(41, -libc::EPERM));
        assert_eq!(
            ack_for(&two, 41).unwrap().unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
    }

    fn nat(ports: Vec<Port>, v6: bool) -> MasqueradeNat {
        MasqueradeNat {
            table: "microvirt-eth0".into(),
            bridge: "k6t-eth0".into(),
            guest_v4: Ipv4Addr::new(10, 0, 2, 2),
            guest_v6: v6.then(|| "fd10:0:2::2".parse().unwrap()),
            pod_interface: Some("eth0".into()),
            ports,
            excluded_tcp_ports: vec![49152, 49153],
        }
    }

    #[test]
    fn all_ports_but_the_migration_listener_go_to_the_guest() {
        let json = serde_json::to_string(&nat(vec![], false).ruleset()).unwrap();
        assert!(json.contains(r#""masquerade":null"#), "{json}");
        assert!(json.contains(r#"{"set":[49152,49153]}"#), "{json}");
        assert!(json.contains(r#""dnat":{"addr":"10.0.2.2"}"#), "{json}");
        assert!(
            !json.contains("ip6"),
            "no IPv6 without a v6 address: {json}"
        );
    }

    #[test]
    fn declared_ports_only_and_both_families() {
        let r = nat(
            vec![
                Port {
                    protocol: Protocol::Tcp,
                    port: 80,
                },
                Port {
                    protocol: Protocol::Udp,
                    port: 53,
                },
            ],
            true,
        );
        let json = serde_json::to_string(&r.ruleset()).unwrap();
        assert!(!json.contains("49152"), "{json}");
        assert!(json.contains(r#"{"payload":{"protocol":"tcp","field":"dport"}}"#));
        assert!(json.contains(r#""right":80"#) && json.contains(r#""right":53"#));
        assert!(json.contains(r#""dnat":{"addr":"fd10:0:2::2"}"#), "{json}");
    }

    #[test]
    fn no_pod_interface_no_inbound_rules() {
        let mut r = nat(vec![], false);
        r.pod_interface = None;
        let json = serde_json::to_string(&r.ruleset()).unwrap();
        assert!(!json.contains("dnat"), "{json}");
    }
}
