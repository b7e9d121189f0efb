//! The virtio-net device driven directly through virtio-queue's mock split queues, on a real
//! TAP in a private network namespace, with an AF_PACKET socket as the far end of the wire.
//! Includes property tests feeding garbage descriptor chains.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tests::PacketSocket;
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};
use vmm::devices::virtio::net::{MacAddr, Net, Tap, VNET_HDR_LEN};
use vmm::devices::virtio::{VirtioDevice, VirtioInterrupt, INT_USED_RING};
use vmm::vm::GuestMemory;
use vmm_sys_util::eventfd::EventFd;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const MEM: u64 = 4 << 20;
const RXQ: u64 = 0x10_0000;
const TXQ: u64 = 0x20_0000;

/// Runs `f` on a thread in a fresh network namespace with a persistent, up TAP `mvt0`.
fn with_tap<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tests::require_kvm(); // not needed by the device, but these tests run as root like the rest
    std::thread::spawn(move || {
        // SAFETY: unshare affects only this thread's network namespace.
        assert_eq!(
            unsafe { libc::unshare(libc::CLONE_NEWNET) },
            0,
            "unshare: {}",
            std::io::Error::last_os_error()
        );
        let out = std::process::Command::new("ip")
            .args(["tuntap", "add", "mvt0", "mode", "tap", "vnet_hdr"])
            .output();
        // `ip` runs in the thread's namespace: children inherit the calling thread's.
        assert!(
            out.map(|o| o.status.success()).unwrap_or(false),
            "ip tuntap add"
        );
        assert!(std::process::Command::new("ip")
            .args(["link", "set", "mvt0", "mtu", "9000", "up"])
            .status()
            .unwrap()
            .success());
        let _ = std::process::Command::new("sysctl")
            .args(["-q", "-w", "net.ipv6.conf.mvt0.disable_ipv6=1"])
            .status();
        f()
    })
    .join()
    .unwrap()
}

struct Rig {
    mem: GuestMemory,
    /// Used ring addresses of the rx and tx queues of the last activation.
    used: [GuestAddress; 2],
    net: Net,
    interrupt: Arc<VirtioInterrupt>,
    irq: EventFd,
}

fn rig() -> Rig {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    let tap = Tap::open("mvt0").unwrap();
    let mut net = Net::new("eth0".into(), tap, MacAddr([0x52, 0x54, 0, 1, 2, 3])).unwrap();
    net.set_acked_features(net.avail_features());
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let interrupt = VirtioInterrupt::new(irq.try_clone().unwrap());
    Rig {
        mem,
        net,
        interrupt,
        irq,
        used: [GuestAddress(0); 2],
    }
}

fn desc(addr: u64, len: u32, flags: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, 0))
}

impl Rig {
    /// Activates with the given rx and tx chains already on the queues.
    fn activate(&mut self, rx: &[Vec<RawDescriptor>], tx: &[Vec<RawDescriptor>]) -> (Queue, Queue) {
        let rxq = MockSplitQueue::create(&self.mem, GuestAddress(RXQ), 256);
        let txq = MockSplitQueue::create(&self.mem, GuestAddress(TXQ), 256);
        // Chain the descriptors of each chain through their `next` fields.
        let link = |q: &MockSplitQueue<GuestMemory>, chains: &[Vec<RawDescriptor>]| {
            let mut off = 0u16;
            for c in chains {
                let linked: Vec<RawDescriptor> = c
                    .iter()
                    .enumerate()
                    .map(|(i, d)| {
                        let d = Descriptor::from(*d);
                        RawDescriptor::from(Descriptor::new(
                            d.addr().0,
                            d.len(),
                            d.flags(),
                            off + i as u16 + 1,
                        ))
                    })
                    .collect();
                q.add_desc_chains(&linked, off).unwrap();
                off += c.len() as u16;
            }
        };
        link(&rxq, rx);
        link(&txq, tx);
        self.used = [rxq.used_addr(), txq.used_addr()];
        let (a, b): (Queue, Queue) = (rxq.create_queue().unwrap(), txq.create_queue().unwrap());
        let copy = |q: &Queue| Queue::try_from(q.state()).unwrap();
        self.net
            .activate(
                self.mem.clone(),
                vec![copy(&a), copy(&b)],
                self.interrupt.clone(),
            )
            .unwrap();
        (a, b)
    }

    /// Activates with empty queues laid out by hand at RXQ and TXQ, for a driver that keeps
    /// adding chains: virtio-queue's MockSplitQueue places the used ring right after the
    /// available ring's first `size` bytes (not `4 + 2 * size + 2`), so past a few entries
    /// its rings overlap. Returns the tx queue's descriptor table and available ring.
    fn activate_open_rings(&mut self) -> (GuestAddress, GuestAddress) {
        let ring = |base: u64| {
            let (desc, avail, used) = (base, base + 0x1000, base + 0x2000);
            for a in [avail, used] {
                self.mem.write_slice(&[0u8; 4], GuestAddress(a)).unwrap();
            }
            let mut q = Queue::new(256).unwrap();
            q.set_size(256);
            q.set_desc_table_address(Some(desc as u32), Some(0));
            q.set_avail_ring_address(Some(avail as u32), Some(0));
            q.set_used_ring_address(Some(used as u32), Some(0));
            q.set_ready(true);
            (q, GuestAddress(used))
        };
        let ((rxq, rx_used), (txq, tx_used)) = (ring(RXQ), ring(TXQ));
        self.used = [rx_used, tx_used];
        self.net
            .activate(self.mem.clone(), vec![rxq, txq], self.interrupt.clone())
            .unwrap();
        (GuestAddress(TXQ), GuestAddress(TXQ + 0x1000))
    }

    fn used_idx(&self, ring_base: u64) -> u16 {
        let used = self.used[(ring_base == TXQ) as usize];
        self.mem.read_obj(used.unchecked_add(2)).unwrap()
    }

    fn used_elem(&self, ring_base: u64, i: u64) -> (u32, u32) {
        let a = self.used[(ring_base == TXQ) as usize].unchecked_add(4 + 8 * i);
        (
            self.mem.read_obj(a).unwrap(),
            self.mem.read_obj(a.unchecked_add(4)).unwrap(),
        )
    }
}

fn eth(len: usize, tag: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&[0x52, 0x54, 0, 1, 2, 3]);
    f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 9]);
    f[12..14].copy_from_slice(&[0x88, 0xb5]);
    f[14..14 + tag.len()].copy_from_slice(tag);
    f
}

#[test]
fn tx_batches_chains_to_the_tap_and_interrupts_once() {
    with_tap(|| {
        let mut r = rig();
        let wire = PacketSocket::bind("mvt0");
        let mut tx = Vec::new();
        for (i, size) in [60usize, 1514, 9000].into_iter().enumerate() {
            let at = 0x30_0000 + i as u64 * 0x4000;
            let f = eth(size, format!("TX{i}").as_bytes());
            r.mem
                .write_slice(&[0u8; VNET_HDR_LEN], GuestAddress(at))
                .unwrap();
            // Header and frame in separate descriptors, the frame split in two.
            r.mem.write_slice(&f, GuestAddress(at + 0x100)).unwrap();
            let half = (size / 2) as u32;
            tx.push(vec![
                desc(at, VNET_HDR_LEN as u32, F_NEXT),
                desc(at + 0x100, half, F_NEXT),
                desc(at + 0x100 + half as u64, size as u32 - half, 0),
            ]);
        }
        r.activate(&[], &tx);
        r.net.process_tx();
        for (i, size) in [60usize, 1514, 9000].into_iter().enumerate() {
            let got = wire
                .recv_matching(Duration::from_secs(5), |f| {
                    f.len() > 16 && f[14..16] == *b"TX"
                })
                .unwrap_or_else(|| panic!("frame {i} not on the wire: {:?}", r.net.counters));
            assert_eq!(got.len(), size);
            assert_eq!(&got[14..17], format!("TX{i}").as_bytes());
        }
        assert_eq!(r.used_idx(TXQ), 3);
        assert_eq!(r.irq.read().unwrap(), 1, "one interrupt for the batch");
        assert_eq!(r.net.counters.tx_frames, 3);
    });
}

/// A guest driver streaming frames on its own thread, kicking only when the used ring does
/// not say VRING_USED_F_NO_NOTIFY (as Linux does without event indices). The device is run
/// only on kicks, so a kick the driver skipped while the device was about to stop would leave
/// frames on the ring for good: every frame must still reach the used ring.
#[test]
fn tx_notifications_are_off_while_draining_and_no_frame_waits_for_a_lost_kick() {
    with_tap(|| {
        const FRAMES: u16 = 3000;
        let mut r = rig();
        let (desc_table, avail) = r.activate_open_rings();
        let (mem, used) = (r.mem.clone(), r.used[1]);
        let frame = eth(60, b"ST");
        for b in 0..8u64 {
            let at = 0x30_0000 + b * 0x1000;
            mem.write_slice(&[0u8; VNET_HDR_LEN], GuestAddress(at))
                .unwrap();
            mem.write_slice(&frame, GuestAddress(at + 0x100)).unwrap();
        }
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let driver_kick = kick.try_clone().unwrap();
        let driver = std::thread::spawn(move || {
            let (mut kicks, mut suppressed) = (0u32, 0u32);
            // Spins until `n` chains are used; false after 10 s (the device loop fails first).
            let used_reaches = |n: u16| {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while mem.read_obj::<u16>(used.unchecked_add(2)).unwrap() < n {
                    if std::time::Instant::now() > deadline {
                        return false;
                    }
                    std::hint::spin_loop();
                }
                true
            };
            let mut burst_end = 0u16;
            for n in 0..FRAMES {
                // At most 128 two-descriptor chains in flight on the 256-entry ring.
                if !used_reaches(n.saturating_sub(127)) {
                    break;
                }
                // Bursts of 1 to 7 frames, each waited for: every burst's last frame is a
                // chance for the device to stop without it.
                if n == burst_end {
                    if !used_reaches(n) {
                        break;
                    }
                    burst_end = n + 1 + n % 7;
                }
                let at = 0x30_0000 + (n as u64 % 8) * 0x1000;
                let d = (n % 128) * 2;
                for (i, raw) in [
                    Descriptor::new(at, VNET_HDR_LEN as u32, F_NEXT, d + 1),
                    Descriptor::new(at + 0x100, frame.len() as u32, 0, 0),
                ]
                .into_iter()
                .enumerate()
                {
                    let slot = desc_table.unchecked_add((d as u64 + i as u64) * 16);
                    mem.write_obj(RawDescriptor::from(raw), slot).unwrap();
                }
                mem.write_obj(d, avail.unchecked_add(4 + 2 * (n as u64 % 256)))
                    .unwrap();
                std::sync::atomic::fence(Ordering::Release);
                mem.write_obj(n.wrapping_add(1), avail.unchecked_add(2))
                    .unwrap();
                std::sync::atomic::fence(Ordering::SeqCst);
                if mem.read_obj::<u16>(used).unwrap() & 1 == 0 {
                    driver_kick.write(1).unwrap();
                    kicks += 1;
                } else {
                    suppressed += 1;
                }
            }
            (kicks, suppressed)
        });
        while r.used_idx(TXQ) != FRAMES {
            let mut pfd = libc::pollfd {
                fd: kick.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the call.
            let ready = unsafe { libc::poll(&mut pfd, 1, 5000) };
            assert!(
                ready == 1,
                "no kick for 5 s with {} of {FRAMES} frames used ({:?}): a kick was lost",
                r.used_idx(TXQ),
                r.net.counters,
            );
            let _ = kick.read();
            r.net.process_tx();
        }
        let (kicks, suppressed) = driver.join().unwrap();
        assert_eq!(r.net.counters.tx_frames, FRAMES as u64);
        assert_eq!(r.net.counters.tx_errors, 0);
        let flags: u16 = r.mem.read_obj(r.used[1]).unwrap();
        assert_eq!(
            flags & 1,
            0,
            "notifications are back on once the ring is drained"
        );
        eprintln!("{kicks} kicks, {suppressed} frames published without one");
    });
}

#[test]
fn rx_waits_for_buffers_and_merges_across_them() {
    with_tap(|| {
        let mut r = rig();
        let wire = PacketSocket::bind("mvt0");
        // No rx buffers yet: a frame arriving now must wait in the TAP, not be dropped.
        r.activate(&[], &[]);
        let big = eth(3000, b"BIG");
        wire.send(&big);
        std::thread::sleep(Duration::from_millis(50));
        r.net.process_rx();
        assert_eq!(r.net.counters.rx_frames, 0);
        assert_eq!(r.net.counters.rx_errors, 0);

        // Now three 1 KiB... and 2 KiB buffers: the 3000-byte frame needs two (mergeable).
        let rx: Vec<Vec<RawDescriptor>> = (0..4)
            .map(|i| vec![desc(0x30_0000 + i * 0x1000, 2048, F_WRITE)])
            .collect();
        r.activate(&rx, &[]);
        r.net.process_rx();
        assert_eq!(r.net.counters.rx_frames, 1, "{:?}", r.net.counters);
        assert_eq!(r.used_idx(RXQ), 2);
        let (id0, len0) = r.used_elem(RXQ, 0);
        let (_, len1) = r.used_elem(RXQ, 1);
        assert_eq!((id0, len0 + len1), (0, (VNET_HDR_LEN + 3000) as u32));
        let num_buffers: u16 = r.mem.read_obj(GuestAddress(0x30_0000 + 10)).unwrap();
        assert_eq!(num_buffers, 2);
        let mut got = vec![0u8; 3000];
        r.mem
            .read_slice(
                &mut got[..2048 - VNET_HDR_LEN],
                GuestAddress(0x30_0000 + VNET_HDR_LEN as u64),
            )
            .unwrap();
        r.mem
            .read_slice(&mut got[2048 - VNET_HDR_LEN..], GuestAddress(0x30_1000))
            .unwrap();
        assert_eq!(got, big);
        assert!(r.interrupt.status.load(Ordering::SeqCst) & INT_USED_RING != 0);
    });
}

fn arb_chain() -> impl Strategy<Value = Vec<(u64, u32, u16)>> {
    proptest::collection::vec(
        (
            prop_oneof![
                0x30_0000u64..0x3f_0000,
                0u64..MEM,
                Just(MEM - 4),
                any::<u64>()
            ],
            prop_oneof![0u32..4096, 0u32..70_000, any::<u32>()],
            0u16..8,
        ),
        1..5,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Garbage rx chains: the device never panics, and writes guest memory only inside
    /// descriptors the driver marked device-writable (and the used ring).
    #[test]
    fn garbage_rx_chains_only_touch_writable_buffers(chains in proptest::collection::vec(arb_chain(), 1..6)) {
        let chains2 = chains.clone();
        let res: Result<(), String> = with_tap(move || {
            let mut r = rig();
            let wire = PacketSocket::bind("mvt0");
            r.mem.write_slice(&vec![0xeeu8; 0x10_0000], GuestAddress(0x30_0000)).unwrap();
            let raw: Vec<Vec<RawDescriptor>> = chains2.iter().map(|c| c.iter().enumerate().map(|(i, &(a, l, f))| {
                let f = if i + 1 < c.len() { f | F_NEXT } else { f & !F_NEXT };
                desc(a, l, f & 0x3)
            }).collect()).collect();
            r.activate(&raw, &[]);
            wire.send(&eth(1000, b"X"));
            std::thread::sleep(Duration::from_millis(5));
            r.net.process_rx();
            // Every byte of the sentinel area outside writable descriptors is untouched.
            let mut area = vec![0u8; 0x10_0000];
            r.mem.read_slice(&mut area, GuestAddress(0x30_0000)).unwrap();
            let mut writable = vec![false; area.len()];
            for &(d, l, f) in chains2.iter().flatten() {
                if f & F_WRITE == 0 {
                    continue;
                }
                let start = d.clamp(0x30_0000, 0x40_0000) - 0x30_0000;
                let end = d.saturating_add(l as u64).clamp(0x30_0000, 0x40_0000) - 0x30_0000;
                writable[start as usize..end as usize].iter_mut().for_each(|w| *w = true);
            }
            if let Some(i) = (0..area.len()).find(|&i| area[i] != 0xee && !writable[i]) {
                return Err(format!("byte at {:#x} written outside a writable descriptor", 0x30_0000 + i));
            }
            drop(wire);
            let _ = r.net.tap().as_raw_fd();
            Ok(())
        });
        prop_assert!(res.is_ok(), "{:?}", res);
    }

    /// Garbage tx chains never panic and never complete more chains than were offered.
    #[test]
    fn garbage_tx_chains_are_contained(chains in proptest::collection::vec(arb_chain(), 1..6)) {
        let n = chains.len() as u16;
        let used = with_tap(move || {
            let mut r = rig();
            let raw: Vec<Vec<RawDescriptor>> = chains.iter().map(|c| c.iter().enumerate().map(|(i, &(a, l, f))| {
                let f = if i + 1 < c.len() { f | F_NEXT } else { f & !F_NEXT };
                desc(a, l, f & 0x3)
            }).collect()).collect();
            r.activate(&[], &raw);
            r.net.process_tx();
            r.used_idx(TXQ)
        });
        prop_assert!(used <= n);
    }
}
