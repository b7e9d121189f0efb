//! The guest's DHCPv4 server: one lease, offered only to the guest's MAC, on a UDP socket bound
//! to the NIC's bridge. KubeVirt's launcher runs the same kind of single-client server for its
//! masquerade and bridge bindings; messages are parsed and built with `dhcproto`.
//!
//! Everything here is fed by the guest: `answer` takes any bytes and answers only a
//! well-formed request from the right MAC (property-tested below).

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};

use api::protocol::DhcpLease;
use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder, Name};

pub const SERVER_PORT: u16 = 67;
pub const CLIENT_PORT: u16 = 68;
/// KubeVirt offers an infinite lease: the address belongs to the VM for its life.
const INFINITE: u32 = u32::MAX;

/// The netmask of a prefix length.
pub fn netmask(prefix_len: u8) -> Ipv4Addr {
    let bits = u32::MAX
        .checked_shl(32 - prefix_len.min(32) as u32)
        .unwrap_or(0);
    Ipv4Addr::from(bits)
}

/// The BOOTP header, the magic cookie, then options.
const OPTIONS_AT: usize = 240;
const MAGIC: [u8; 4] = [99, 130, 83, 99];

/// `datagram` with only the options this server reads (message type, requested address,
/// server identifier), each of its one valid length, or None when the option area is not
/// well formed. dhcproto's option decoder trusts option lengths (debug assertions and an
/// unchecked `len - 1` on guest-chosen lengths, found by the property tests below), so it is
/// only ever given options this function has checked.
fn sanitize(datagram: &[u8]) -> Option<Vec<u8>> {
    if datagram.len() < OPTIONS_AT || datagram[236..OPTIONS_AT] != MAGIC {
        return None;
    }
    let mut out = datagram[..OPTIONS_AT].to_vec();
    let mut i = OPTIONS_AT;
    while i < datagram.len() {
        let code = datagram[i];
        match code {
            0 => {
                i += 1;
                continue;
            }
            255 => break,
            _ => {}
        }
        let len = *datagram.get(i + 1)? as usize;
        let value = datagram.get(i + 2..i + 2 + len)?;
        let wanted = match code {
            53 => 1,
            50 | 54 => 4,
            _ => usize::MAX,
        };
        if len == wanted {
            out.extend_from_slice(&datagram[i..i + 2]);
            out.extend_from_slice(value);
        }
        i += 2 + len;
    }
    out.push(255);
    Some(out)
}

/// The reply to one datagram from the guest, or None when it gets none (not DHCP, not a
/// request, another client's MAC, a message type a single-lease server ignores).
pub fn answer(datagram: &[u8], mac: [u8; 6], lease: &DhcpLease) -> Option<Vec<u8>> {
    let datagram = sanitize(datagram)?;
    let req = Message::decode(&mut Decoder::new(&datagram)).ok()?;
    // `chaddr()` slices by the guest's `hlen` and panics past 16 (dhcproto 0.15; the property
    // test below found it): only Ethernet's 6 is looked at.
    if req.opcode() != Opcode::BootRequest || req.hlen() != 6 || req.chaddr() != mac {
        return None;
    }
    let kind = match req.opts().get(OptionCode::MessageType)? {
        DhcpOption::MessageType(t) => *t,
        _ => return None,
    };
    let reply_type = match kind {
        MessageType::Discover => MessageType::Offer,
        MessageType::Request => {
            let requested = match req.opts().get(OptionCode::RequestedIpAddress) {
                Some(DhcpOption::RequestedIpAddress(a)) => *a,
                _ => req.ciaddr(),
            };
            let for_us = match req.opts().get(OptionCode::ServerIdentifier) {
                Some(DhcpOption::ServerIdentifier(s)) => *s == lease.server,
                _ => true,
            };
            if !for_us {
                // The guest chose another server's offer: stay silent (RFC 2131 §4.3.2).
                return None;
            }
            if requested == lease.address {
                MessageType::Ack
            } else {
                MessageType::Nak
            }
        }
        // A client that already has its address asks for the other parameters.
        MessageType::Inform => MessageType::Ack,
        _ => return None,
    };
    let mut reply = Message::default();
    reply
        .set_opcode(Opcode::BootReply)
        .set_xid(req.xid())
        .set_flags(req.flags())
        .set_chaddr(&mac)
        .set_giaddr(req.giaddr());
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::MessageType(reply_type));
    opts.insert(DhcpOption::ServerIdentifier(lease.server));
    if reply_type != MessageType::Nak {
        if kind == MessageType::Inform {
            reply.set_ciaddr(req.ciaddr());
        } else {
            reply.set_yiaddr(lease.address);
            reply
                .opts_mut()
                .insert(DhcpOption::AddressLeaseTime(INFINITE));
        }
        let opts = reply.opts_mut();
        opts.insert(DhcpOption::SubnetMask(netmask(lease.prefix_len)));
        if let Some(r) = lease.router {
            opts.insert(DhcpOption::Router(vec![r]));
        }
        if !lease.dns.is_empty() {
            opts.insert(DhcpOption::DomainNameServer(lease.dns.clone()));
        }
        let search: Vec<Name> = lease
            .search
            .iter()
            .filter_map(|d| Name::from_utf8(d).ok())
            .collect();
        if let Some(first) = lease.search.first() {
            opts.insert(DhcpOption::DomainName(first.clone()));
        }
        if !search.is_empty() {
            opts.insert(DhcpOption::DomainSearch(search));
        }
        if let Some(mtu) = lease.mtu {
            opts.insert(DhcpOption::InterfaceMtu(mtu));
        }
        if let Some(h) = &lease.hostname {
            opts.insert(DhcpOption::Hostname(h.clone()));
        }
    }
    // Replies are broadcast: the guest has no address to unicast to yet, and a broadcast needs
    // no ARP entry for it.
    reply.set_flags(Flags::default().set_broadcast());
    let mut out = Vec::with_capacity(300);
    reply.encode(&mut Encoder::new(&mut out)).ok()?;
    Some(out)
}

/// A UDP socket on port 67, bound to `device` (SO_BINDTODEVICE, so it hears the guest's
/// broadcasts on that bridge only), allowed to broadcast. Needs CAP_NET_RAW: virt-handler makes
/// it and hands it to the unprivileged launcher.
pub fn server_socket(device: &str) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM.cloexec(), Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    s.set_broadcast(true)?;
    s.bind_device(Some(device.as_bytes()))?;
    s.bind(&SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, SERVER_PORT).into())?;
    Ok(s.into())
}

/// Serves `lease` to `mac` on `socket` until the socket fails (it is closed when the launcher
/// exits). Runs on a thread of its own.
pub fn serve(socket: UdpSocket, mac: [u8; 6], lease: DhcpLease) {
    let mut buf = [0u8; 1500];
    let to = SocketAddrV4::new(Ipv4Addr::BROADCAST, CLIENT_PORT);
    loop {
        let n = match socket.recv_from(&mut buf) {
            Ok((n, _)) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!("DHCP server: {e}");
                return;
            }
        };
        if let Some(reply) = answer(&buf[..n], mac, &lease) {
            match socket.send_to(&reply, to) {
                Ok(_) => tracing::debug!(address = %lease.address, "DHCP reply sent"),
                Err(e) => tracing::warn!("DHCP reply: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 1, 2, 3];

    fn lease() -> DhcpLease {
        DhcpLease {
            address: Ipv4Addr::new(10, 0, 2, 2),
            prefix_len: 24,
            router: Some(Ipv4Addr::new(10, 0, 2, 1)),
            server: Ipv4Addr::new(10, 0, 2, 1),
            dns: vec![Ipv4Addr::new(10, 96, 0, 10)],
            search: vec!["default.svc.cluster.local".into(), "cluster.local".into()],
            mtu: Some(1450),
            hostname: Some("vm1".into()),
        }
    }

    fn request(kind: MessageType, mac: [u8; 6], extra: &[DhcpOption]) -> Vec<u8> {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootRequest)
            .set_xid(0x1234_5678)
            .set_chaddr(&mac);
        m.opts_mut().insert(DhcpOption::MessageType(kind));
        for o in extra {
            m.opts_mut().insert(o.clone());
        }
        let mut out = Vec::new();
        m.encode(&mut Encoder::new(&mut out)).unwrap();
        out
    }

    fn decode(b: &[u8]) -> Message {
        Message::decode(&mut Decoder::new(b)).unwrap()
    }

    fn kind(m: &Message) -> MessageType {
        match m.opts().get(OptionCode::MessageType) {
            Some(DhcpOption::MessageType(t)) => *t,
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn discover_gets_an_offer_with_everything_the_guest_needs() {
        let offer =
            decode(&answer(&request(MessageType::Discover, MAC, &[]), MAC, &lease()).unwrap());
        assert_eq!(kind(&offer), MessageType::Offer);
        assert_eq!(offer.xid(), 0x1234_5678);
        assert_eq!(offer.yiaddr(), Ipv4Addr::new(10, 0, 2, 2));
        let o = offer.opts();
        assert_eq!(
            o.get(OptionCode::SubnetMask),
            Some(&DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)))
        );
        assert_eq!(
            o.get(OptionCode::Router),
            Some(&DhcpOption::Router(vec![Ipv4Addr::new(10, 0, 2, 1)]))
        );
        assert_eq!(
            o.get(OptionCode::DomainNameServer),
            Some(&DhcpOption::DomainNameServer(vec![Ipv4Addr::new(
                10, 96, 0, 10
            )]))
        );
        assert_eq!(
            o.get(OptionCode::InterfaceMtu),
            Some(&DhcpOption::InterfaceMtu(1450))
        );
        assert_eq!(
            o.get(OptionCode::Hostname),
            Some(&DhcpOption::Hostname("vm1".into()))
        );
        assert!(o.get(OptionCode::DomainSearch).is_some());
        assert!(offer.flags().broadcast());
    }

    #[test]
    fn request_for_the_lease_is_acked_anything_else_naked_or_ignored() {
        let l = lease();
        let ack = |extra: &[DhcpOption]| {
            answer(&request(MessageType::Request, MAC, extra), MAC, &l).map(|b| kind(&decode(&b)))
        };
        assert_eq!(
            ack(&[
                DhcpOption::RequestedIpAddress(l.address),
                DhcpOption::ServerIdentifier(l.server)
            ]),
            Some(MessageType::Ack)
        );
        assert_eq!(
            ack(&[DhcpOption::RequestedIpAddress(Ipv4Addr::new(10, 0, 2, 9))]),
            Some(MessageType::Nak)
        );
        assert_eq!(
            ack(&[
                DhcpOption::RequestedIpAddress(l.address),
                DhcpOption::ServerIdentifier(Ipv4Addr::new(192, 0, 2, 1))
            ]),
            None,
            "another server's offer was taken"
        );
        let other_mac = [2, 0, 0, 0, 0, 9];
        assert_eq!(
            answer(&request(MessageType::Discover, other_mac, &[]), MAC, &l),
            None,
            "only the guest's MAC is answered"
        );
        assert_eq!(
            answer(&request(MessageType::Release, MAC, &[]), MAC, &l),
            None
        );
    }

    #[test]
    fn netmasks() {
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(32), Ipv4Addr::BROADCAST);
        assert_eq!(netmask(0), Ipv4Addr::UNSPECIFIED);
        assert_eq!(netmask(200), Ipv4Addr::BROADCAST);
    }

    proptest! {
        /// Whatever the guest sends, the server neither panics nor answers another MAC.
        #[test]
        fn hostile_datagrams(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Some(r) = answer(&bytes, MAC, &lease()) {
                let m = decode(&r);
                prop_assert_eq!(&m.chaddr()[..6], &MAC[..]);
            }
        }

        /// A valid header and magic cookie, then any option bytes at all.
        #[test]
        fn hostile_options(opts in proptest::collection::vec(any::<u8>(), 0..400)) {
            let mut b = request(MessageType::Discover, MAC, &[]);
            b.truncate(OPTIONS_AT);
            b.extend(opts);
            let _ = answer(&b, MAC, &lease());
        }

        /// A real request with its bytes flipped: never a panic.
        #[test]
        fn mutated_requests(pos in 0usize..400, val in any::<u8>()) {
            let mut b = request(MessageType::Discover, MAC, &[]);
            if pos < b.len() { b[pos] = val; }
            let _ = answer(&b, MAC, &lease());
        }
    }
}
