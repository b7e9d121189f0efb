//! The plain-HTTP endpoint Prometheus scrapes: `/metrics` (what the caller renders, in
//! OpenMetrics text) and `/healthz`. virt-controller and virt-handler serve the same one.
//! hyper directly rather than a web framework: two fixed routes do not need a router, and the
//! node agent keeps one HTTP stack (hyper, which tonic already brings).

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves until the listener fails; each connection on its own task.
pub async fn serve_text(
    listener: tokio::net::TcpListener,
    render: impl Fn() -> String + Clone + Send + Sync + 'static,
) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let render = render.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let render = render.clone();
                async move { Ok::<_, Infallible>(answer(&req, render)) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!("metrics connection: {e}");
            }
        });
    }
}

fn answer<B>(req: &Request<B>, render: impl Fn() -> String) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, content_type: &str, body: String| {
        Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .expect("a fixed status and header make a valid response")
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET and HEAD\n".into(),
        );
    }
    match req.uri().path() {
        "/metrics" => reply(StatusCode::OK, OPENMETRICS, render()),
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok".into()),
        other => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("{other}: not found (this endpoint serves /metrics and /healthz)\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: std::net::SocketAddr, request: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_metrics_healthz_and_refuses_the_rest() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve_text(l, || "# EOF\n".to_string()));
        let close = "Host: x\r\nConnection: close\r\n\r\n";
        let m = get(addr, &format!("GET /metrics HTTP/1.1\r\n{close}")).await;
        assert!(m.starts_with("HTTP/1.1 200"), "{m}");
        assert!(m.contains(OPENMETRICS) && m.ends_with("# EOF\n"), "{m}");
        let h = get(addr, &format!("GET /healthz HTTP/1.1\r\n{close}")).await;
        assert!(h.starts_with("HTTP/1.1 200") && h.ends_with("ok"), "{h}");
        let n = get(addr, &format!("GET /x HTTP/1.1\r\n{close}")).await;
        assert!(
            n.starts_with("HTTP/1.1 404") && n.contains("/metrics and /healthz"),
            "{n}"
        );
        let p = get(
            addr,
            &format!("POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n{close}"),
        )
        .await;
        assert!(p.starts_with("HTTP/1.1 405"), "{p}");
    }
}
