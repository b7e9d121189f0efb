//! `virtctl image-upload`'s two calls, as CDI serves them: an `UploadTokenRequest`
//! (`upload.cdi.kubevirt.io/v1beta1`, behind the API server like the subresources, so the
//! caller is who the API server says and RBAC decides) answered with a token for one claim,
//! valid five minutes; and the upload proxy (`POST /v1beta1/upload`, straight to virt-api with
//! that token as the only credential), which streams the body to the claim's importer Pod.
//! The token is an ES256 JWT signed with the key virt-controller keeps in a Secret of this
//! namespace; the importer checks it again, so neither the proxy nor the Pod takes data for a
//! claim the token does not name.

use std::sync::Arc;

use api::cdi::upload::{self, TokenClaims};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use controller_runtime::tls::PeerCertificate;
use http::{HeaderMap, StatusCode};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::Api;
use serde_json::{json, Value};

use crate::authz::{authorize, Access};
use crate::server::ApiState;
use crate::status::SubresourceError;

pub fn router() -> Router<Arc<ApiState>> {
    let base = format!("/apis/{}/{}", upload::GROUP, upload::VERSION);
    Router::new()
        .route(&base, get(discovery))
        .route(
            &format!("{base}/namespaces/{{namespace}}/{}", upload::PLURAL),
            post(token_request),
        )
        .route(upload::UPLOAD_PATH, post(proxy).head(|| async { "ok" }))
}

async fn discovery() -> Json<Value> {
    Json(json!({
        "kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": format!("{}/{}", upload::GROUP, upload::VERSION),
        "resources": [{"name": upload::PLURAL, "singularName": "uploadtokenrequest",
            "namespaced": true, "kind": "UploadTokenRequest", "verbs": ["create"]}],
    }))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// The signing key pair's halves (PEM) from virt-controller's Secret.
async fn key(state: &ApiState, half: &str) -> Result<String, SubresourceError> {
    let secrets: Api<Secret> = Api::namespaced(state.client.clone(), &state.namespace);
    let missing = || {
        SubresourceError::new(
            503,
            "ServiceUnavailable",
            "no upload signing key yet: virt-controller makes it for the first DataVolume with source.upload",
        )
    };
    let s = secrets
        .get_opt(upload::KEY_SECRET)
        .await
        .map_err(|e| SubresourceError::internal(format!("reading the signing key: {e}")))?
        .ok_or_else(missing)?;
    s.data
        .and_then(|d| {
            d.get(half)
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        })
        .ok_or_else(missing)
}

/// `POST …/namespaces/NS/uploadtokenrequests`: a token for `spec.pvcName`, to whoever may
/// create UploadTokenRequests there (CDI's RBAC: `cdi.kubevirt.io:edit` and admin).
async fn token_request(
    State(state): State<Arc<ApiState>>,
    Extension(peer): Extension<PeerCertificate>,
    Path(namespace): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Response, SubresourceError> {
    let who = state.front_proxy.identify(&peer, &headers)?;
    let pvc = body
        .pointer("/spec/pvcName")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
        .ok_or_else(|| SubresourceError::bad_request("spec.pvcName: is required"))?
        .to_string();
    let access = Access {
        group: upload::GROUP,
        verb: "create",
        resource: upload::PLURAL,
        subresource: "",
        namespace: &namespace,
        name: "",
    };
    authorize(&state.client, &who, &access).await?;
    let private = key(&state, upload::PRIVATE_KEY).await?;
    let signing = jsonwebtoken::EncodingKey::from_ec_pem(private.as_bytes())
        .map_err(|e| SubresourceError::internal(format!("the signing key: {e}")))?;
    let iat = now();
    let claims = TokenClaims {
        pvc: pvc.clone(),
        namespace: namespace.clone(),
        iat,
        exp: iat + upload::TOKEN_TTL_SECS,
    };
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256),
        &claims,
        &signing,
    )
    .map_err(|e| SubresourceError::internal(format!("signing the token: {e}")))?;
    tracing::info!(user = %who.user, %namespace, %pvc, "upload token issued");
    let mut obj = body;
    obj["apiVersion"] = json!(format!("{}/{}", upload::GROUP, upload::VERSION));
    obj["kind"] = json!("UploadTokenRequest");
    obj["metadata"]["namespace"] = json!(namespace);
    obj["status"] = json!({ "token": token });
    Ok((StatusCode::CREATED, Json(obj)).into_response())
}

/// `POST /v1beta1/upload`: the body, streamed to the importer Pod of the claim the token
/// names (`importer-<claim>`, port 8443), its answer returned as it is.
async fn proxy(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, SubresourceError> {
    let unauthorized = |why: &str| SubresourceError::new(401, "Unauthorized", why.to_string());
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| unauthorized("an upload token is required (Authorization: Bearer)"))?;
    let public = key(&state, upload::PUBLIC_KEY).await?;
    let decoding = jsonwebtoken::DecodingKey::from_ec_pem(public.as_bytes())
        .map_err(|e| SubresourceError::internal(format!("the signing key: {e}")))?;
    let validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::ES256);
    let claims = jsonwebtoken::decode::<TokenClaims>(bearer, &decoding, &validation)
        .map_err(|e| unauthorized(&format!("the upload token is not valid: {e}")))?
        .claims;
    let pods: Api<Pod> = Api::namespaced(state.client.clone(), &claims.namespace);
    let pod_name = format!("importer-{}", claims.pvc);
    let unready = || {
        SubresourceError::new(
            503,
            "ServiceUnavailable",
            format!(
                "the upload server for {}/{} is not ready (its DataVolume is not UploadReady)",
                claims.namespace, claims.pvc
            ),
        )
    };
    let pod = pods
        .get_opt(&pod_name)
        .await
        .map_err(|e| SubresourceError::internal(format!("finding the upload server: {e}")))?
        .ok_or_else(unready)?;
    let ip = pod.status.and_then(|s| s.pod_ip).ok_or_else(unready)?;
    let addr = format!("{ip}:{}", api::cdi::importer::METRICS_PORT);
    let tcp = tokio::net::TcpStream::connect(&addr)
        .await
        .map_err(|_| unready())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| SubresourceError::internal(format!("the upload server: {e}")))?;
    tokio::spawn(conn);
    let mut req = http::Request::post(upload::UPLOAD_PATH)
        .header(http::header::HOST, addr.clone())
        .header(http::header::AUTHORIZATION, format!("Bearer {bearer}"));
    if let Some(len) = headers.get(http::header::CONTENT_LENGTH) {
        req = req.header(http::header::CONTENT_LENGTH, len);
    }
    let req = req
        .body(body)
        .map_err(|e| SubresourceError::internal(e.to_string()))?;
    tracing::info!(namespace = %claims.namespace, pvc = %claims.pvc, "upload proxied");
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| SubresourceError::internal(format!("the upload broke off: {e}")))?;
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, Body::new(body)))
}
