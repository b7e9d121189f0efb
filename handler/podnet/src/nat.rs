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
pub fn remove(table: &str) {
    for family in [NfFamily::IP, NfFamily::IP6] {
        let t = NfListObject::Table(Table {
            family,
            name: table.to_string().into(),
            handle: None,
        });
        let mut batch = Batch::new();
        batch.add(t.clone());
        batch.delete(t);
        if let Err(e) = nftables::helper::apply_ruleset(&batch.to_nftables()) {
            tracing::debug!(table, "removing NAT table: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
