//! A websocket carrying a byte stream (a console, a forwarded TCP connection): what the
//! stream gives goes out as binary messages, what the peer sends (binary or text) is written
//! to it, until either side ends. KubeVirt's `plain.kubevirt.io` subprotocol is exactly this.

use axum::extract::ws::{Message, WebSocket};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Relays between `socket` and the stream's two halves until either side ends.
pub async fn relay<R, W>(socket: WebSocket, mut reader: R, mut writer: W)
where
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
                    if to_peer
                        .send(Message::Binary(buf[..n].to_vec().into()))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        let _ = to_peer.close().await;
    };
    let input = async {
        while let Some(Ok(m)) = from_peer.next().await {
            let bytes = match m {
                Message::Binary(b) => b.to_vec(),
                Message::Text(t) => t.as_bytes().to_vec(),
                Message::Close(_) => break,
                _ => continue,
            };
            if writer.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = writer.shutdown().await;
    };
    tokio::select! {
        _ = out => {}
        _ = input => {}
    }
}
