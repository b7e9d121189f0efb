//! Source checks on what a guest sends: every frame that enters the Pod's network from the
//! guest's TAP must carry the guest's MAC, and its IPv4/ARP/IPv6 source must be the address the
//! guest was leased (DHCP from 0.0.0.0, ARP probes and IPv6 link-local/unspecified sources
//! excepted). Anything else is dropped and counted, so one tenant's guest cannot pose as
//! another host on the Pod network — the masquerade NAT would otherwise carry a forged source
//! out of the Pod, and a bridge binding would put it straight on the Pod's network.
//!
//! One nftables table per TAP in the `netdev` family, its chain on the TAP's ingress hook
//! (before the bridge or the routing stack sees the frame), with a named counter the node
//! agent reads for its metrics.

use std::net::{Ipv4Addr, Ipv6Addr};

use serde_json::{json, Value};

/// The counter each table keeps of dropped frames.
pub const COUNTER: &str = "spoofed";
/// Every guard table's name starts so (then the VMI interface's name, or the standalone tag).
pub const TABLE_PREFIX: &str = "microvirt-src-";

/// What may leave one guest's TAP.
#[derive(Clone, Debug)]
pub struct GuestSource {
    pub table: String,
    pub tap: String,
    pub mac: [u8; 6],
    /// The leased IPv4 address; None: no IPv4 source is the guest's (only DHCP may be sent).
    /// With neither address known, only the MAC is checked.
    pub v4: Option<Ipv4Addr>,
    /// The guest's global IPv6 address, if it has one.
    pub v6: Option<Ipv6Addr>,
}

fn mac_text(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn is(left: Value, right: Value) -> Value {
    json!({"match": {"op": "==", "left": left, "right": right}})
}

fn is_not(left: Value, right: Value) -> Value {
    json!({"match": {"op": "!=", "left": left, "right": right}})
}

fn field(protocol: &str, name: &str) -> Value {
    json!({"payload": {"protocol": protocol, "field": name}})
}

fn protocol() -> Value {
    json!({"meta": {"key": "protocol"}})
}

impl GuestSource {
    /// The table as one nft JSON transaction (replacing an older table of the same name).
    pub fn ruleset(&self) -> Value {
        let mac = mac_text(&self.mac);
        let drop = |mut exprs: Vec<Value>| {
            exprs.push(json!({"counter": COUNTER}));
            exprs.push(json!({"drop": null}));
            exprs
        };
        let accept = |mut exprs: Vec<Value>| {
            exprs.push(json!({"accept": null}));
            exprs
        };
        let mut rules: Vec<Vec<Value>> = Vec::new();
        // Another source MAC, on any frame.
        rules.push(drop(vec![is_not(field("ether", "saddr"), json!(mac))]));
        // VLAN tags (802.1Q, 802.1ad) would carry a packet past the checks below unread.
        rules.push(drop(vec![is(
            field("ether", "type"),
            json!({"set": ["8021q", "8021ad"]}),
        )]));
        // A network the node gave the guest no address on (a Multus network without IPAM):
        // the guest picks its own, so only its MAC is held to it.
        if self.v4.is_none() && self.v6.is_none() {
            return self.transaction(rules);
        }
        // IPv4: the lease, or DHCP before there is one.
        if let Some(v4) = self.v4 {
            rules.push(accept(vec![
                is(protocol(), json!("ip")),
                is(field("ip", "saddr"), json!(v4.to_string())),
            ]));
        }
        rules.push(accept(vec![
            is(protocol(), json!("ip")),
            is(field("ip", "saddr"), json!("0.0.0.0")),
            is(field("udp", "sport"), json!(68)),
            is(field("udp", "dport"), json!(67)),
        ]));
        rules.push(drop(vec![is(protocol(), json!("ip"))]));
        // ARP: the sender hardware address is the guest's, the sender address its lease (or
        // 0.0.0.0, an address probe).
        rules.push(drop(vec![
            is(protocol(), json!("arp")),
            is_not(field("arp", "saddr ether"), json!(mac)),
        ]));
        let mut arp_sources = vec![json!("0.0.0.0")];
        if let Some(v4) = self.v4 {
            arp_sources.push(json!(v4.to_string()));
        }
        rules.push(accept(vec![
            is(protocol(), json!("arp")),
            is(field("arp", "saddr ip"), json!({"set": arp_sources})),
        ]));
        rules.push(drop(vec![is(protocol(), json!("arp"))]));
        // IPv6: link-local and unspecified (neighbour discovery, DAD), and the guest's own.
        if let Some(v6) = self.v6 {
            rules.push(accept(vec![
                is(protocol(), json!("ip6")),
                is(field("ip6", "saddr"), json!(v6.to_string())),
            ]));
        }
        rules.push(accept(vec![
            is(protocol(), json!("ip6")),
            is(
                field("ip6", "saddr"),
                json!({"prefix": {"addr": "fe80::", "len": 10}}),
            ),
        ]));
        rules.push(accept(vec![
            is(protocol(), json!("ip6")),
            is(field("ip6", "saddr"), json!("::")),
        ]));
        rules.push(drop(vec![is(protocol(), json!("ip6"))]));
        self.transaction(rules)
    }

    /// The nft JSON transaction that (re)creates the table with `rules` on the TAP's ingress.
    fn transaction(&self, rules: Vec<Vec<Value>>) -> Value {
        let t = json!({"family": "netdev", "name": self.table});
        let mut cmds = vec![
            json!({"add": {"table": t}}),
            json!({"delete": {"table": t}}),
            json!({"add": {"table": t}}),
            json!({"add": {"counter": {"family": "netdev", "table": self.table, "name": COUNTER}}}),
            json!({"add": {"chain": {
                "family": "netdev", "table": self.table, "name": "guest",
                "type": "filter", "hook": "ingress", "dev": self.tap, "prio": -500,
                "policy": "accept"
            }}}),
        ];
        for expr in rules {
            cmds.push(json!({"add": {"rule": {
                "family": "netdev", "table": self.table, "chain": "guest", "expr": expr
            }}}));
        }
        json!({"nftables": cmds})
    }

    /// Programs the table (checked against nftables' JSON schema first).
    pub fn apply(&self) -> Result<(), String> {
        let text = self.ruleset().to_string();
        let parsed: nftables::schema::Nftables = serde_json::from_str(&text)
            .map_err(|e| format!("source guard for {}: {e}", self.tap))?;
        nftables::helper::apply_ruleset(&parsed)
            .map_err(|e| format!("source guard for {}: nftables: {e}", self.tap))
    }
}

/// Removes a guard table; one that is not there is not an error.
pub fn remove(table: &str) {
    crate::nat::remove_family(libc::NFPROTO_NETDEV as u8, table);
}

/// The frames each guard table in this network namespace has dropped: (the table's name
/// after `TABLE_PREFIX`, packets).
pub fn dropped() -> Result<Vec<(String, u64)>, String> {
    let out = std::process::Command::new("nft")
        .args(["-j", "list", "counters"])
        .output()
        .map_err(|e| format!("running nft: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "nft list counters: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("nft's JSON: {e}"))?;
    Ok(counters(&v))
}

/// The guard counters in an `nft -j list counters` answer.
fn counters(v: &Value) -> Vec<(String, u64)> {
    let Some(items) = v.get("nftables").and_then(Value::as_array) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|i| i.get("counter"))
        .filter(|c| c.get("family").and_then(Value::as_str) == Some("netdev"))
        .filter(|c| c.get("name").and_then(Value::as_str) == Some(COUNTER))
        .filter_map(|c| {
            let table = c.get("table")?.as_str()?.strip_prefix(TABLE_PREFIX)?;
            Some((table.to_string(), c.get("packets")?.as_u64()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_parses_as_nftables_json() {
        let g = GuestSource {
            table: format!("{TABLE_PREFIX}default"),
            tap: "tap0".into(),
            mac: [0x52, 0x54, 0, 1, 2, 3],
            v4: Some(Ipv4Addr::new(10, 0, 2, 2)),
            v6: Some("fd10:0:2::2".parse().unwrap()),
        };
        let text = g.ruleset().to_string();
        let _: nftables::schema::Nftables = serde_json::from_str(&text).unwrap();
        assert!(text.contains("52:54:00:01:02:03") && text.contains("\"dev\":\"tap0\""));
    }

    /// Without any address known (a Multus network without IPAM) the guest's own addresses
    /// pass: only the MAC and VLAN tags are checked.
    #[test]
    fn without_addresses_only_the_mac_is_held() {
        let g = GuestSource {
            table: format!("{TABLE_PREFIX}blue"),
            tap: "tap1".into(),
            mac: [0x52, 0x54, 0, 1, 2, 3],
            v4: None,
            v6: None,
        };
        let text = g.ruleset().to_string();
        let _: nftables::schema::Nftables = serde_json::from_str(&text).unwrap();
        assert!(text.contains("52:54:00:01:02:03"), "{text}");
        assert!(!text.contains("\"ip\"") && !text.contains("arp"), "{text}");
    }

    #[test]
    fn counters_of_guard_tables_only() {
        let v = json!({"nftables": [
            {"metainfo": {"version": "1.0.6"}},
            {"counter": {"family": "netdev", "table": "microvirt-src-default", "name": "spoofed", "packets": 3, "bytes": 180}},
            {"counter": {"family": "ip", "table": "microvirt-src-x", "name": "spoofed", "packets": 9, "bytes": 1}},
            {"counter": {"family": "netdev", "table": "other", "name": "spoofed", "packets": 9, "bytes": 1}},
            {"counter": {"family": "netdev", "table": "microvirt-src-net1", "name": "spoofed", "packets": 0, "bytes": 0}}
        ]});
        assert_eq!(
            counters(&v),
            vec![("default".to_string(), 3), ("net1".to_string(), 0)]
        );
        assert!(counters(&json!({})).is_empty());
    }
}
