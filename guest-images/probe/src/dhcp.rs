//! `probe.test=dhcp probe.peer=A.B.C.D:PORT [probe.echoes=N]`: configure the NIC by DHCP
//! (discover, offer, request, ack), resolve the next hop by ARP once, then send N (default 1)
//! numbered UDP datagrams to the peer one after the other, each repeated until it comes back (a
//! UDP echo on the far side of the Pod's NAT). The guest answers ARP for its address meanwhile,
//! as the gateway asks before it delivers an echo. Many echoes keep the guest talking while it
//! is live-migrated: the same MAC, address and ARP entry must keep working on the new node.
//!
//! With `probe.spoof=1` the guest first forges, before its first honest datagram: one from
//! another source address (`MVPROBE spoof ip`) and one from another source MAC
//! (`MVPROBE spoof mac`), each sent three times — the node's source guard drops all six, and
//! the honest datagrams after them still come back.

use core::fmt::Write;

use crate::net::Nic;
use crate::{result, Line};

const ETH_IP: u16 = 0x0800;
const ETH_ARP: u16 = 0x0806;
const XID: u32 = 0x4d56_5052;
const CLIENT_PORT: u16 = 68;
const SERVER_PORT: u16 = 67;
const PROBE_PORT: u16 = 40000;
/// Each wait for an answer; the request is repeated a few times (a lost broadcast, a server
/// not yet listening).
const SPINS: u32 = 20_000_000;
const TRIES: u32 = 8;

struct Lease {
    addr: [u8; 4],
    mask: [u8; 4],
    router: [u8; 4],
    server: [u8; 4],
    dns: [u8; 4],
    mtu: u16,
    hostname: [u8; 32],
    hostname_len: usize,
}

fn parse_ip(s: &str) -> Option<[u8; 4]> {
    let mut out = [0u8; 4];
    let mut parts = s.split('.');
    for o in out.iter_mut() {
        *o = parts.next()?.parse().ok()?;
    }
    parts.next().is_none().then_some(out)
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            (c[0] as u16) << 8
        };
        sum += w as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Ethernet + IPv4 + UDP around `payload` (UDP checksum 0: optional over IPv4).
#[allow(clippy::too_many_arguments)]
fn udp_frame(
    out: &mut [u8],
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    sport: u16,
    dport: u16,
    payload: &[u8],
) -> usize {
    let ip_len = 20 + 8 + payload.len();
    out[0..6].copy_from_slice(&dst_mac);
    out[6..12].copy_from_slice(&src_mac);
    out[12..14].copy_from_slice(&ETH_IP.to_be_bytes());
    let ip = &mut out[14..34];
    ip.fill(0);
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&src);
    ip[16..20].copy_from_slice(&dst);
    let c = checksum(ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let udp = &mut out[34..42];
    udp[0..2].copy_from_slice(&sport.to_be_bytes());
    udp[2..4].copy_from_slice(&dport.to_be_bytes());
    udp[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    udp[6..8].fill(0);
    out[42..42 + payload.len()].copy_from_slice(payload);
    (42 + payload.len()).max(60)
}

/// A BOOTP request of DHCP type `kind` (with the requested address and server for a REQUEST).
fn bootp(out: &mut [u8], mac: [u8; 6], kind: u8, req: Option<([u8; 4], [u8; 4])>) -> usize {
    out[..300].fill(0);
    out[0] = 1; // BOOTREQUEST
    out[1] = 1; // Ethernet
    out[2] = 6;
    out[4..8].copy_from_slice(&XID.to_be_bytes());
    out[10] = 0x80; // broadcast flag: answer by broadcast, we have no address yet
    out[28..34].copy_from_slice(&mac);
    out[236..240].copy_from_slice(&[99, 130, 83, 99]);
    let mut i = 240;
    let mut opt = |code: u8, val: &[u8], i: &mut usize| {
        out[*i] = code;
        out[*i + 1] = val.len() as u8;
        out[*i + 2..*i + 2 + val.len()].copy_from_slice(val);
        *i += 2 + val.len();
    };
    opt(53, &[kind], &mut i);
    if let Some((addr, server)) = req {
        opt(50, &addr, &mut i);
        opt(54, &server, &mut i);
    }
    opt(55, &[1, 3, 6, 12, 15, 26, 119], &mut i);
    out[i] = 255;
    300
}

/// The UDP payload of an IPv4 frame to `port`, with the sender's address and port.
fn udp_payload(f: &[u8], port: u16) -> Option<(&[u8], [u8; 4], u16)> {
    if f.len() < 42 || u16::from_be_bytes([f[12], f[13]]) != ETH_IP || f[23] != 17 {
        return None;
    }
    let ihl = ((f[14] & 0x0f) as usize) * 4;
    let udp = 14 + ihl;
    if ihl < 20 || f.len() < udp + 8 {
        return None;
    }
    if u16::from_be_bytes([f[udp + 2], f[udp + 3]]) != port {
        return None;
    }
    let len = (u16::from_be_bytes([f[udp + 4], f[udp + 5]]) as usize).checked_sub(8)?;
    let body = f.get(udp + 8..udp + 8 + len)?;
    let src: [u8; 4] = f[26..30].try_into().ok()?;
    Some((body, src, u16::from_be_bytes([f[udp], f[udp + 1]])))
}

/// A DHCP reply for us: its type, yiaddr and the options we use.
fn dhcp_reply(body: &[u8], mac: [u8; 6], lease: &mut Lease) -> Option<u8> {
    if body.len() < 240 || body[0] != 2 || body[4..8] != XID.to_be_bytes() || body[28..34] != mac {
        return None;
    }
    if body[236..240] != [99, 130, 83, 99] {
        return None;
    }
    lease.addr.copy_from_slice(&body[16..20]);
    let mut kind = None;
    let mut i = 240;
    while i + 1 < body.len() && body[i] != 255 {
        if body[i] == 0 {
            i += 1;
            continue;
        }
        let (code, len) = (body[i], body[i + 1] as usize);
        let v = body.get(i + 2..i + 2 + len)?;
        match (code, len) {
            (53, 1) => kind = Some(v[0]),
            (1, 4) => lease.mask.copy_from_slice(v),
            (3, l) if l >= 4 => lease.router.copy_from_slice(&v[..4]),
            (6, l) if l >= 4 => lease.dns.copy_from_slice(&v[..4]),
            (54, 4) => lease.server.copy_from_slice(v),
            (26, 2) => lease.mtu = u16::from_be_bytes([v[0], v[1]]),
            (12, l) => {
                let n = l.min(lease.hostname.len());
                lease.hostname[..n].copy_from_slice(&v[..n]);
                lease.hostname_len = n;
            }
            _ => {}
        }
        i += 2 + len;
    }
    kind
}

fn arp(
    out: &mut [u8],
    op: u16,
    src_mac: [u8; 6],
    src: [u8; 4],
    dst_mac: [u8; 6],
    dst: [u8; 4],
) -> usize {
    let eth_dst = if op == 1 { [0xff; 6] } else { dst_mac };
    out[0..6].copy_from_slice(&eth_dst);
    out[6..12].copy_from_slice(&src_mac);
    out[12..14].copy_from_slice(&ETH_ARP.to_be_bytes());
    let a = &mut out[14..42];
    a[0..2].copy_from_slice(&1u16.to_be_bytes());
    a[2..4].copy_from_slice(&ETH_IP.to_be_bytes());
    a[4] = 6;
    a[5] = 4;
    a[6..8].copy_from_slice(&op.to_be_bytes());
    a[8..14].copy_from_slice(&src_mac);
    a[14..18].copy_from_slice(&src);
    a[18..24].copy_from_slice(&dst_mac);
    a[24..28].copy_from_slice(&dst);
    out[42..60].fill(0);
    60
}

/// Answers an ARP request for `ip`; returns the sender of an ARP reply.
fn handle_arp(nic: &mut Nic, f: &[u8], mac: [u8; 6], ip: [u8; 4]) -> Option<([u8; 4], [u8; 6])> {
    if f.len() < 42 || u16::from_be_bytes([f[12], f[13]]) != ETH_ARP {
        return None;
    }
    let op = u16::from_be_bytes([f[20], f[21]]);
    let sha: [u8; 6] = f[22..28].try_into().ok()?;
    let spa: [u8; 4] = f[28..32].try_into().ok()?;
    let tpa: [u8; 4] = f[38..42].try_into().ok()?;
    if op == 1 && tpa == ip {
        let mut out = [0u8; 64];
        let n = arp(&mut out, 2, mac, ip, sha, spa);
        let _ = nic.send(&out[..n]);
    }
    (op == 2).then_some((spa, sha))
}

fn in_subnet(a: [u8; 4], b: [u8; 4], mask: [u8; 4]) -> bool {
    (0..4).all(|i| a[i] & mask[i] == b[i] & mask[i])
}

fn prefix_len(mask: [u8; 4]) -> u32 {
    u32::from_be_bytes(mask).count_ones()
}

pub fn run(cmdline: &str) -> ! {
    let peer = cmdline
        .split(' ')
        .find_map(|w| w.strip_prefix("probe.peer="))
        .and_then(|p| {
            let (ip, port) = p.split_once(':')?;
            Some((parse_ip(ip)?, port.parse::<u16>().ok()?))
        });
    let Some(peer) = peer else {
        result(false, format_args!("probe.peer=A.B.C.D:PORT is missing"))
    };
    let spoof = cmdline.split_whitespace().any(|w| w == "probe.spoof=1");
    let echoes = cmdline
        .split(' ')
        .find_map(|w| w.strip_prefix("probe.echoes="))
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(1);
    match crate::net::open(cmdline)
        .and_then(|(nic, mac, _)| exchange(nic, mac, peer, echoes, spoof))
    {
        Ok(line) => result(true, format_args!("{}", line.as_str())),
        Err(e) => result(false, format_args!("{e}")),
    }
}

fn exchange(
    mut nic: Nic,
    mac: [u8; 6],
    peer: ([u8; 4], u16),
    echoes: u32,
    spoof: bool,
) -> Result<Line, &'static str> {
    let mut frame = [0u8; 1514];
    let mut rx = [0u8; 1514];
    let lease = lease(&mut nic, mac, &mut frame, &mut rx)?;
    let me = lease.addr;
    let hop = if in_subnet(peer.0, me, lease.mask) {
        peer.0
    } else {
        lease.router
    };
    let hop_mac = resolve(&mut nic, (mac, me), hop, &mut frame, &mut rx)?;
    if spoof {
        // Another host's address, then another card's MAC: neither may leave the Pod.
        let mut forged_ip = me;
        forged_ip[3] = forged_ip[3].wrapping_add(97);
        let mut forged_mac = mac;
        forged_mac[5] ^= 0x55;
        for (src_mac, src_ip, msg) in [
            (mac, forged_ip, &b"MVPROBE spoof ip"[..]),
            (forged_mac, me, &b"MVPROBE spoof mac"[..]),
        ] {
            for _ in 0..3 {
                let len = udp_frame(
                    &mut frame, hop_mac, src_mac, src_ip, peer.0, PROBE_PORT, peer.1, msg,
                );
                nic.send(&frame[..len])?;
            }
        }
    }
    // UDP to the peer, and its echo back, `echoes` times.
    for k in 0..echoes {
        let mut msg = Line::new();
        let _ = write!(msg, "MVPROBE udp hello {k}");
        echo(
            &mut nic,
            &mut frame,
            &mut rx,
            (mac, me),
            hop_mac,
            peer,
            msg.as_str().as_bytes(),
        )?;
    }
    let mut out = Line::new();
    let ip = |a: [u8; 4]| (a[0], a[1], a[2], a[3]);
    let (a, b, c, d) = ip(me);
    let (r1, r2, r3, r4) = ip(lease.router);
    let (n1, n2, n3, n4) = ip(lease.dns);
    let _ = write!(
        out,
        "ip={a}.{b}.{c}.{d}/{} router={r1}.{r2}.{r3}.{r4} dns={n1}.{n2}.{n3}.{n4} mtu={} hostname={} echoes={echoes}{}",
        prefix_len(lease.mask),
        lease.mtu,
        core::str::from_utf8(&lease.hostname[..lease.hostname_len]).unwrap_or("?"),
        if spoof { " forged=2" } else { "" },
    );
    Ok(out)
}

/// DISCOVER → OFFER, then REQUEST → ACK: the lease.
fn lease(
    nic: &mut Nic,
    mac: [u8; 6],
    frame: &mut [u8; 1514],
    rx: &mut [u8; 1514],
) -> Result<Lease, &'static str> {
    let mut body = [0u8; 400];
    let mut lease = Lease {
        addr: [0; 4],
        mask: [0; 4],
        router: [0; 4],
        server: [0; 4],
        dns: [0; 4],
        mtu: 0,
        hostname: [0; 32],
        hostname_len: 0,
    };
    let mut offered = None;
    for (kind, want) in [(1u8, 2u8), (3, 5)] {
        let mut got = false;
        'tries: for _ in 0..TRIES {
            let req = offered.map(|a| (a, lease.server));
            let n = bootp(&mut body, mac, kind, req);
            let len = udp_frame(
                frame,
                [0xff; 6],
                mac,
                [0; 4],
                [255; 4],
                CLIENT_PORT,
                SERVER_PORT,
                &body[..n],
            );
            nic.send(&frame[..len])?;
            for _ in 0..16 {
                let Some(n) = nic.recv(rx, SPINS) else {
                    continue 'tries;
                };
                let Some((b, _, _)) = udp_payload(&rx[..n], CLIENT_PORT) else {
                    continue;
                };
                match dhcp_reply(b, mac, &mut lease) {
                    Some(6) => return Err("DHCP NAK"),
                    Some(k) if k == want => {
                        got = true;
                        break 'tries;
                    }
                    _ => {}
                }
            }
        }
        if !got {
            return Err(if kind == 1 {
                "no DHCP offer"
            } else {
                "no DHCP ack"
            });
        }
        offered = Some(lease.addr);
    }
    Ok(lease)
}

/// The MAC of `hop`, by ARP from `me` (MAC, address).
fn resolve(
    nic: &mut Nic,
    me: ([u8; 6], [u8; 4]),
    hop: [u8; 4],
    frame: &mut [u8; 1514],
    rx: &mut [u8; 1514],
) -> Result<[u8; 6], &'static str> {
    for _ in 0..TRIES {
        let n = arp(frame, 1, me.0, me.1, [0; 6], hop);
        nic.send(&frame[..n])?;
        for _ in 0..16 {
            let Some(n) = nic.recv(rx, SPINS) else {
                break;
            };
            if let Some((spa, sha)) = handle_arp(nic, &rx[..n], me.0, me.1) {
                if spa == hop {
                    return Ok(sha);
                }
            }
        }
    }
    Err("no ARP reply from the next hop")
}

/// Sends `msg` from `me` (MAC, address) to `peer` through `hop_mac` until it comes back,
/// answering ARP meanwhile.
fn echo(
    nic: &mut Nic,
    frame: &mut [u8; 1514],
    rx: &mut [u8; 1514],
    me: ([u8; 6], [u8; 4]),
    hop_mac: [u8; 6],
    peer: ([u8; 4], u16),
    msg: &[u8],
) -> Result<(), &'static str> {
    let (mac, ip) = me;
    for _ in 0..TRIES {
        let len = udp_frame(frame, hop_mac, mac, ip, peer.0, PROBE_PORT, peer.1, msg);
        nic.send(&frame[..len])?;
        for _ in 0..16 {
            let Some(n) = nic.recv(rx, SPINS) else {
                break;
            };
            handle_arp(nic, &rx[..n], mac, ip);
            if let Some((b, src, sport)) = udp_payload(&rx[..n], PROBE_PORT) {
                if src == peer.0 && sport == peer.1 && b == msg {
                    return Ok(());
                }
            }
        }
    }
    Err("no UDP echo from the peer")
}
