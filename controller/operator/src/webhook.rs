//! The operator's own admission webhook, as KubeVirt's `virt-operator-validator` has it: the
//! deletion of a deployed `KubeVirt` CR whose `uninstallStrategy` is
//! `BlockUninstallIfWorkloadsExist` (the default) is refused while VMs, VMIs, replica sets or
//! pools exist, so `kubectl delete kv` fails at once with the reason instead of leaving a CR
//! stuck in Deleting. (The finalizer still holds the installation if the webhook is bypassed.)
//!
//! The webhook serves the certificate the operator issues into the Secret
//! `kubevirt-operator-certs` ([`crate::certs::SERVED`]); every replica reads it back from
//! the Secret, so a rotation reaches them all without a restart.

use std::sync::Arc;
use std::time::Duration;

use api::kubevirt::{KubeVirt, KubeVirtPhase, BLOCK_UNINSTALL_IF_WORKLOADS_EXIST};
use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use controller_runtime::tls::{ServingCert, SwappableCert};
use k8s_openapi::api::core::v1::Secret;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::DynamicObject;
use kube::{Api, Client};

/// The Secret holding the webhook's serving certificate.
pub const SECRET: &str = "kubevirt-operator-certs";
/// Where the API server sends a KubeVirt CR's deletion.
pub const DELETE_PATH: &str = "/kubevirt-validate-delete";

/// How the uninstall strategy judges a deletion, given whether workloads remain.
pub fn deletion_verdict(kv: &KubeVirt, workloads: Option<String>) -> Result<(), String> {
    let strategy = kv
        .spec
        .uninstall_strategy
        .as_deref()
        .unwrap_or(BLOCK_UNINSTALL_IF_WORKLOADS_EXIST);
    // Only an installation that is deployed holds workloads; a second CR, one still
    // deploying or one already being deleted goes.
    let deployed = kv.status.as_ref().and_then(|s| s.phase) == Some(KubeVirtPhase::Deployed);
    match workloads {
        Some(why) if strategy == BLOCK_UNINSTALL_IF_WORKLOADS_EXIST && deployed => Err(format!(
            "{why}: spec.uninstallStrategy is {BLOCK_UNINSTALL_IF_WORKLOADS_EXIST}; delete them \
             first, or set it to RemoveWorkloads"
        )),
        _ => Ok(()),
    }
}

async fn validate_delete(
    State(client): State<Client>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let req: Result<AdmissionRequest<DynamicObject>, _> = review.try_into();
    let resp = match req {
        Ok(req) => decide(&client, &req).await,
        Err(e) => AdmissionResponse::invalid(format!("not an AdmissionReview request: {e}")),
    };
    Json(resp.into_review())
}

async fn decide(client: &Client, req: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let resp = AdmissionResponse::from(req);
    if req.operation != Operation::Delete {
        return resp;
    }
    let Some(old) = &req.old_object else {
        return resp.deny("the request carries no oldObject to judge");
    };
    let kv: KubeVirt = match serde_json::to_value(old).and_then(serde_json::from_value) {
        Ok(kv) => kv,
        Err(e) => return resp.deny(format!("the KubeVirt CR cannot be decoded: {e}")),
    };
    match crate::reconcile::workloads_present(client).await {
        Ok(workloads) => match deletion_verdict(&kv, workloads) {
            Ok(()) => resp,
            Err(why) => resp.deny(why),
        },
        Err(e) => resp.deny(format!("cannot tell whether workloads remain: {e}")),
    }
}

/// The webhook's routes.
pub fn router(client: Client) -> Router {
    Router::new()
        .route(DELETE_PATH, post(validate_delete))
        .with_state(client)
}

/// Keeps `cert` at the pair in Secret `namespace/SECRET`, looking every few seconds (the
/// operator's reconcile issues and rotates it; other replicas learn of it here).
pub async fn follow_secret(client: Client, namespace: String, cert: Arc<SwappableCert>) {
    let secrets: Api<Secret> = Api::namespaced(client, &namespace);
    let mut seen: Option<String> = None;
    loop {
        match secrets.get_opt(SECRET).await {
            Ok(Some(s)) if s.metadata.resource_version != seen => {
                let field = |k: &str| s.data.as_ref().and_then(|d| d.get(k)).map(|b| b.0.clone());
                if let (Some(crt), Some(key)) = (field("tls.crt"), field("tls.key")) {
                    match ServingCert::from_pem(&crt, SECRET, &key, SECRET)
                        .and_then(|pair| cert.set(pair))
                    {
                        Ok(()) => {
                            tracing::info!(secret = SECRET, "webhook serving certificate loaded");
                            seen = s.metadata.resource_version.clone();
                        }
                        Err(e) => tracing::warn!(error = %e, "webhook certificate not loaded"),
                    }
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "reading the webhook certificate"),
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(strategy: Option<&str>, phase: Option<KubeVirtPhase>) -> KubeVirt {
        let mut kv = KubeVirt::new("kubevirt", Default::default());
        kv.spec.uninstall_strategy = strategy.map(str::to_string);
        kv.status = Some(api::kubevirt::KubeVirtStatus {
            phase,
            ..Default::default()
        });
        kv
    }

    #[test]
    fn a_deployed_installation_with_workloads_is_kept_by_default() {
        let vms = Some("there are still Virtual Machines present".to_string());
        let e =
            deletion_verdict(&kv(None, Some(KubeVirtPhase::Deployed)), vms.clone()).unwrap_err();
        assert!(
            e.starts_with("there are still Virtual Machines present"),
            "{e}"
        );
        assert!(e.contains("RemoveWorkloads"), "{e}");
        assert!(deletion_verdict(&kv(None, Some(KubeVirtPhase::Deployed)), None).is_ok());
        assert!(deletion_verdict(
            &kv(Some("RemoveWorkloads"), Some(KubeVirtPhase::Deployed)),
            vms.clone()
        )
        .is_ok());
        assert!(deletion_verdict(&kv(None, Some(KubeVirtPhase::Deploying)), vms.clone()).is_ok());
        assert!(deletion_verdict(&kv(None, None), vms).is_ok());
    }
}
