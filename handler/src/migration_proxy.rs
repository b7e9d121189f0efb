//! Migrations between nodes are carried by the node agents, as KubeVirt's migration proxy
//! carries them: source Pod's unix socket ↔ source virt-handler ↔ mutual TLS ↔ target
//! virt-handler ↔ target Pod's unix socket. Launchers never listen on the Pod network and never
//! hold a key: a tenant can exec into its own launcher Pod, so anything there is the tenant's.
//!
//! Each node has its own certificate, signed by the cluster's CA, with the node's name as its
//! DNS name; each end checks that the peer is the node the migration names (the target
//! checks the client against `sourceNode`, the source the server against `targetNode`), so one
//! node's key cannot pose as another. A target accepts connections until one authenticates,
//! each TLS handshake within `HANDSHAKE_DEADLINE`, the whole wait within the caller's
//! deadline: a stranger that connects and trickles bytes holds nothing up.
//!
//! The target launcher takes its first link as the conversation and the rest as page streams,
//! which are silent until the conversation's handshake is done: links must reach it in the
//! order the source opened them. Handshakes finish in any order under load, so the target
//! answers each link with `LINK_TAKEN` once it is connected to the target launcher, and the
//! source opens the next link only after that answer.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use api::protocol::MigrationTls;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// How long a peer has to finish the TLS handshake (and show its certificate).
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// The byte the target writes on a link once it has carried it to the target launcher.
pub const LINK_TAKEN: u8 = 0x4b;

/// How long the source waits for `LINK_TAKEN`: the target may take up to `HANDSHAKE_DEADLINE`
/// to reach its launcher.
const TAKEN_DEADLINE: Duration = Duration::from_secs(20);

/// This node's migration identity: its certificate and key, and the CA every node's is signed
/// by (`--migration-tls-dir`). Held by virt-handler only.
#[derive(Clone)]
pub struct NodeTls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl NodeTls {
    pub fn new(tls: &MigrationTls) -> Result<NodeTls, String> {
        let mut roots = rustls::RootCertStore::empty();
        for c in tls.ca_certs()? {
            roots.add(c).map_err(|e| format!("CA: {e}"))?;
        }
        let roots = Arc::new(roots);
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .build()
                .map_err(|e| format!("client verifier: {e}"))?;
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(tls.cert_chain()?, tls.private_key()?)
            .map_err(|e| format!("certificate: {e}"))?;
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(tls.cert_chain()?, tls.private_key()?)
            .map_err(|e| format!("certificate: {e}"))?;
        Ok(NodeTls {
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

fn node_name(node: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(node.to_string())
        .map_err(|_| format!("node name {node:?} is not a DNS name a certificate can carry"))
}

/// True when the client certificate of `conn` is issued for `node` (its DNS name).
fn peer_is_node(conn: &rustls::ServerConnection, node: &ServerName<'_>) -> bool {
    let Some(cert) = conn.peer_certificates().and_then(|c| c.first()) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|c| c.verify_is_valid_for_subject_name(node).is_ok())
}

/// Connects to a launcher's migration socket in its Pod's directory, links refused and the
/// listener checked to be that Pod's (`launcher::connect_pod_socket`), retrying until it exists or `within` has passed.
async fn connect_launcher(
    pods_dir: &Path,
    socket: &Path,
    within: Duration,
) -> Result<tokio::net::UnixStream, String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match crate::launcher::connect_pod_socket(pods_dir, socket).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(format!("{}: {e}", socket.display()))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn pipe<A, B>(mut a: A, mut b: B) -> Result<(u64, u64), String>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    tokio::io::copy_bidirectional(&mut a, &mut b)
        .await
        .map_err(|e| e.to_string())
}

/// Waits for every pipe of one migration; the bytes carried each way, summed, or the first
/// pipe's error.
async fn join_pipes(
    pipes: Vec<tokio::task::JoinHandle<Result<(u64, u64), String>>>,
) -> Result<(u64, u64), String> {
    let mut carried = (0, 0);
    let mut first_error = None;
    for p in pipes {
        match p.await.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok((a, b)) => carried = (carried.0 + a, carried.1 + b),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    first_error.map_or(Ok(carried), Err)
}

/// The target side: listens on `ip` (port chosen by the kernel) and returns the address to
/// publish; then, in the background, takes `links` connections that authenticate as
/// `source_node` (or, without TLS, the first `links` connections) within `deadline` — the
/// conversation and its page streams — and pipes each to a connection of its own to the
/// target launcher's socket `socket` below `pods_dir`, in the order they authenticated,
/// answering each with `LINK_TAKEN` (the source opens one link at a time, so that is the order
/// it opened them). `done` gets the outcome once every pipe has ended.
#[allow(clippy::too_many_arguments)]
pub async fn serve_target(
    ip: IpAddr,
    tls: Option<NodeTls>,
    source_node: String,
    links: usize,
    pods_dir: PathBuf,
    socket: PathBuf,
    deadline: Duration,
    done: impl FnOnce(Result<(u64, u64), String>) + Send + 'static,
) -> Result<SocketAddr, String> {
    let expected = node_name(&source_node)?;
    let listener = TcpListener::bind((ip, 0))
        .await
        .map_err(|e| format!("cannot listen for the migration on {ip}: {e}"))?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        // Handshakes run side by side: a peer that trickles its handshake delays nobody else.
        let (won, mut winner) = tokio::sync::mpsc::channel::<Box<dyn Stream>>(links.max(1));
        let mut pipes = Vec::with_capacity(links);
        let accepted = tokio::time::timeout(deadline, async {
            while pipes.len() < links {
                tokio::select! {
                    Some(mut remote) = winner.recv() => {
                        let local = connect_launcher(&pods_dir, &socket, HANDSHAKE_DEADLINE)
                            .await
                            .map_err(|e| format!("the target launcher's migration socket: {e}"))?;
                        taken(&mut remote).await?;
                        pipes.push(tokio::spawn(pipe(remote, local)));
                    }
                    a = listener.accept() => {
                        let (tcp, peer) = a.map_err(|e| e.to_string())?;
                        let _ = tcp.set_nodelay(true);
                        let Some(tls) = &tls else {
                            let _ = won.try_send(Box::new(tcp));
                            continue;
                        };
                        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
                        let (won, expected, source_node) = (won.clone(), expected.clone(), source_node.clone());
                        tokio::spawn(async move {
                            match tokio::time::timeout(HANDSHAKE_DEADLINE, acceptor.accept(tcp)).await {
                                Ok(Ok(s)) if peer_is_node(s.get_ref().1, &expected) => {
                                    tracing::info!(%peer, node = %source_node, "migration source authenticated");
                                    let _ = won.try_send(Box::new(s));
                                }
                                Ok(Ok(_)) => tracing::warn!(%peer, "migration connection refused: its certificate is not {source_node:?}'s"),
                                Ok(Err(e)) => tracing::warn!(%peer, "migration connection refused: {e}"),
                                Err(_) => tracing::warn!(%peer, "migration connection dropped: no TLS handshake within {HANDSHAKE_DEADLINE:?}"),
                            }
                        });
                    }
                }
            }
            Ok::<_, String>(())
        })
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "no source authenticated as {source_node:?} within {deadline:?} ({} of {links} links)",
                pipes.len()
            ))
        });
        drop(listener);
        let outcome = match accepted {
            Ok(()) => join_pipes(pipes).await,
            Err(e) => {
                for p in pipes {
                    p.abort();
                }
                Err(e)
            }
        };
        done(outcome);
    });
    Ok(address)
}

/// The source side: takes the `links` streams the source launcher offers on `socket` (below
/// `pods_dir`) — the conversation, then its page streams — and carries each, one after the
/// other, to the target node's handler at `target`, whose certificate must be
/// `target_node`'s; the next link is opened once the target has answered `LINK_TAKEN`.
pub async fn carry_source(
    tls: Option<NodeTls>,
    target: &str,
    target_node: &str,
    links: usize,
    pods_dir: &Path,
    socket: &Path,
    within: Duration,
) -> Result<(u64, u64), String> {
    let name = node_name(target_node)?;
    let mut pipes = Vec::with_capacity(links);
    let opened = async {
        for _ in 0..links {
            let local = connect_launcher(pods_dir, socket, within).await?;
            let tcp = tokio::time::timeout(HANDSHAKE_DEADLINE, TcpStream::connect(target))
                .await
                .map_err(|_| format!("the target node's handler at {target} did not answer"))?
                .map_err(|e| format!("cannot reach the target node's handler at {target}: {e}"))?;
            let _ = tcp.set_nodelay(true);
            let mut remote: Box<dyn Stream> = match &tls {
                None => Box::new(tcp),
                Some(tls) => {
                    let connector = tokio_rustls::TlsConnector::from(tls.client.clone());
                    let remote = tokio::time::timeout(
                        HANDSHAKE_DEADLINE,
                        connector.connect(name.clone(), tcp),
                    )
                    .await
                    .map_err(|_| {
                        format!("no TLS handshake with {target} within {HANDSHAKE_DEADLINE:?}")
                    })?
                    .map_err(|e| {
                        format!("TLS with the target node {target_node:?} at {target}: {e}")
                    })?;
                    Box::new(remote)
                }
            };
            await_taken(&mut remote, target).await?;
            pipes.push(tokio::spawn(pipe(local, remote)));
        }
        Ok::<_, String>(())
    }
    .await;
    if let Err(e) = opened {
        for p in pipes {
            p.abort();
        }
        return Err(e);
    }
    join_pipes(pipes).await
}

/// The target's answer on a link it has carried to its launcher.
async fn taken(remote: &mut Box<dyn Stream>) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    tokio::time::timeout(HANDSHAKE_DEADLINE, async {
        remote.write_all(&[LINK_TAKEN]).await?;
        remote.flush().await
    })
    .await
    .map_err(|_| "the source did not take the link's answer".to_string())?
    .map_err(|e| format!("answering the source: {e}"))
}

/// The source's wait for the target's `LINK_TAKEN` on a link.
async fn await_taken(remote: &mut Box<dyn Stream>, target: &str) -> Result<(), String> {
    use tokio::io::AsyncReadExt;
    let mut b = [0u8];
    tokio::time::timeout(TAKEN_DEADLINE, remote.read_exact(&mut b))
        .await
        .map_err(|_| format!("the target node's handler at {target} did not take the link within {TAKEN_DEADLINE:?}"))?
        .map_err(|e| format!("the target node's handler at {target} closed the link: {e}"))?;
    if b[0] != LINK_TAKEN {
        return Err(format!(
            "the target node's handler at {target} answered {:#04x}, not a taken link",
            b[0]
        ));
    }
    Ok(())
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target whose only callers are a trickler (a byte a second, never a handshake) and a
    /// real certificate of another node gives up at its deadline with the reason — it does not
    /// wait on them — and afterwards nothing listens on its address.
    #[tokio::test]
    async fn strangers_alone_end_the_target_wait_at_its_deadline() {
        let base = std::env::temp_dir().join(format!("mv-proxy-{}", std::process::id()));
        let dirs = ::tests::tls::write_dirs(&base, &["node-1", "node-2", "node-3"]);
        let tls = |i: usize| NodeTls::new(&MigrationTls::from_dir(&dirs[i]).unwrap()).unwrap();
        let (done_tx, done) = tokio::sync::oneshot::channel();
        let deadline = Duration::from_secs(2);
        let started = tokio::time::Instant::now();
        let address = serve_target(
            "127.0.0.1".parse().unwrap(),
            Some(tls(1)),
            "node-1".into(),
            1,
            base.clone(),
            base.join("migration-in.sock"),
            deadline,
            move |outcome| {
                let _ = done_tx.send(outcome);
            },
        )
        .await
        .unwrap();
        let trickler = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut s = TcpStream::connect(address).await.unwrap();
            for _ in 0..30 {
                if s.write_all(&[0x16]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        // node-3's own certificate, presented for node-1's migration.
        let impostor = tokio_rustls::TlsConnector::from(tls(2).client.clone());
        let tcp = TcpStream::connect(address).await.unwrap();
        let _ = impostor
            .connect(ServerName::try_from("node-2").unwrap(), tcp)
            .await;
        let outcome = done.await.unwrap();
        let waited = started.elapsed();
        let e = outcome.unwrap_err();
        assert!(e.contains("no source authenticated as \"node-1\""), "{e}");
        assert!(waited >= deadline && waited < deadline * 3, "{waited:?}");
        assert!(
            TcpStream::connect(address).await.is_err(),
            "still listening after the deadline"
        );
        trickler.abort();
        let _ = std::fs::remove_dir_all(base);
    }

    /// The source opens a link only once the target has answered the one before with
    /// `LINK_TAKEN`: a target whose handshakes finish out of order still hands the launcher
    /// the conversation first. Here the target answers the conversation's link a second late;
    /// no second connection may come before that answer, and the links arrive in the order the
    /// source launcher offered them.
    #[tokio::test]
    async fn the_source_opens_each_link_after_the_target_has_taken_the_one_before() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let base = std::env::temp_dir().join(format!("mv-proxy-order-{}", std::process::id()));
        let dirs = ::tests::tls::write_dirs(&base, &["node-1", "node-2"]);
        let tls = |i: usize| NodeTls::new(&MigrationTls::from_dir(&dirs[i]).unwrap()).unwrap();
        // The source launcher: offers three links on its Pod's socket, each naming itself
        // (and gives up after 30 s, should this test fail before it is done).
        let pod_uid = format!("proxy-order-{}", std::process::id());
        let pods_dir = base.join("pods");
        let socket = pods_dir.join(&pod_uid).join("migration-out.sock");
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let mut offer = std::process::Command::new("python3");
        offer.args([
            "-c",
            "import socket,sys\n\
             socket.setdefaulttimeout(30)\n\
             l=socket.socket(socket.AF_UNIX)\nl.bind(sys.argv[1])\nl.listen(8)\n\
             c=[]\n\
             for i in range(3):\n    s,_=l.accept()\n    s.sendall(b'link%d' % i)\n    c.append(s)\n\
             for s in c:\n    s.recv(1)\n",
        ]);
        offer.arg(&socket);
        ::tests::in_pod_cgroup(&mut offer, &pod_uid);
        let mut offer = offer.spawn().unwrap();

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap().to_string();
        let acceptor = tokio_rustls::TlsAcceptor::from(tls(1).server.clone());
        let node_1 = tls(0);
        let carried = tokio::spawn(async move {
            carry_source(
                Some(node_1),
                &target,
                "node-2",
                3,
                &pods_dir,
                &socket,
                Duration::from_secs(10),
            )
            .await
        });
        let mut order = Vec::new();
        let mut links = Vec::new();
        for i in 0..3 {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut s = acceptor.accept(tcp).await.unwrap();
            if i == 0 {
                let early = tokio::time::timeout(Duration::from_secs(1), listener.accept()).await;
                assert!(
                    early.is_err(),
                    "a second link opened before the first was taken"
                );
            }
            s.write_all(&[LINK_TAKEN]).await.unwrap();
            s.flush().await.unwrap();
            let mut name = [0u8; 5];
            s.read_exact(&mut name).await.unwrap();
            order.push(String::from_utf8_lossy(&name).into_owned());
            links.push(s);
        }
        assert_eq!(order, ["link0", "link1", "link2"]);
        // The target ends each link; the source launcher then closes its side.
        for s in &mut links {
            s.shutdown().await.unwrap();
        }
        let (sent, received) = carried.await.unwrap().unwrap();
        drop(links);
        assert_eq!((sent, received), (15, 0), "bytes carried each way");
        assert!(offer.wait().unwrap().success());
        let _ = std::fs::remove_dir(::tests::pod_cgroup(&pod_uid));
        let _ = std::fs::remove_dir_all(base);
    }
}
