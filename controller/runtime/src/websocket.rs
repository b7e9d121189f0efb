//! A websocket carrying a byte stream (a console, a forwarded TCP connection): what the
//! stream gives goes out as binary messages, what the peer sends (binary or text) is written
//! to it, until either side ends. KubeVirt's `plain.kubevirt.io` subprotocol is exactly this.
//! One relay serves both ends: axum's server sockets (virt-api, virt-handler) and
//! tungstenite's client sockets (virtctl).

use futures::{Sink, SinkExt, Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a websocket message means to a byte stream.
pub enum Payload {
    Bytes(Vec<u8>),
    Close,
    /// A control frame (ping, pong): nothing for the stream.
    Skip,
}

/// A websocket message type the relay can carry bytes in.
pub trait Frame: Sized {
    fn binary(bytes: Vec<u8>) -> Self;
    fn payload(self) -> Payload;
}

/// axum's and tungstenite's messages have the same variants (axum re-exports tungstenite's
/// payload types under its own enum), so one body serves both.
macro_rules! frame {
    ($message:ty) => {
        impl Frame for $message {
            fn binary(bytes: Vec<u8>) -> Self {
                Self::Binary(bytes.into())
            }
            fn payload(self) -> Payload {
                match self {
                    Self::Binary(b) => Payload::Bytes(b.to_vec()),
                    Self::Text(t) => Payload::Bytes(t.as_bytes().to_vec()),
                    Self::Close(_) => Payload::Close,
                    _ => Payload::Skip,
                }
            }
        }
    };
}

frame!(axum::extract::ws::Message);
frame!(tungstenite::Message);

/// When the stream's reading half ends first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtEnd {
    /// The relay ends (a server whose upstream is gone).
    Stop,
    /// The websocket is closed for sending but the peer's answer is still written out, until
    /// the peer closes (a client whose input ended: the guest may still answer it).
    AwaitPeer,
}

/// Relays between `socket` and the stream's two halves until either side ends.
pub async fn relay<S, M, E, R, W>(socket: S, mut reader: R, mut writer: W, at_end: AtEnd)
where
    S: Stream<Item = Result<M, E>> + Sink<M>,
    M: Frame,
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut to_peer, mut from_peer) = socket.split();
    let out = async {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_peer.send(M::binary(buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to_peer.close().await;
        if at_end == AtEnd::AwaitPeer {
            std::future::pending::<()>().await
        }
    };
    let input = async {
        while let Some(Ok(m)) = from_peer.next().await {
            let bytes = match m.payload() {
                Payload::Bytes(b) => b,
                Payload::Close => break,
                Payload::Skip => continue,
            };
            if writer.write_all(&bytes).await.is_err() {
                break;
            }
            let _ = writer.flush().await;
        }
        let _ = writer.shutdown().await;
    };
    tokio::select! {
        _ = out => {}
        _ = input => {}
    }
}
