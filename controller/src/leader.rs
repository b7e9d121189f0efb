//! Leader election through a coordination.k8s.io/v1 Lease, with client-go's rules: a replica
//! takes the Lease when it is free or its holder has not renewed it within
//! `leaseDurationSeconds`; the holder renews every `retry_period`; a holder that cannot renew
//! within `renew_deadline` stops acting (the process exits and restarts as a follower); every
//! write carries the resourceVersion it read, so two candidates never both win.
//!
//! Hand-written because kube-rs has no leader election and the crates that add one pull in
//! their own kube versions; the protocol is a few dozen lines.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, PostParams};
use kube::Client;

use controller_runtime::{is_conflict, is_not_found};

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry.
    pub fn new(namespace: &str, name: &str, identity: &str) -> LeaseConfig {
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

pub struct LeaderElector {
    api: Api<Lease>,
    cfg: LeaseConfig,
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

impl LeaderElector {
    pub fn new(client: Client, cfg: LeaseConfig) -> LeaderElector {
        LeaderElector {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
        }
    }

    fn expired(&self, spec: &LeaseSpec) -> bool {
        let Some(renewed) = spec.renew_time.as_ref() else {
            return true;
        };
        let duration = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.cfg.lease_duration);
        let age = k8s_openapi::jiff::Timestamp::now().duration_since(renewed.0);
        age.as_secs_f64() > duration.as_secs_f64()
    }

    /// One attempt to take or renew the Lease; true when this replica holds it afterwards.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let lease = match self.api.get(&self.cfg.name).await {
            Ok(l) => Some(l),
            Err(e) if is_not_found(&e) => None,
            Err(e) => return Err(e),
        };
        let mine = |transitions: i32, acquired: Option<MicroTime>| LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            lease_duration_seconds: Some(self.cfg.lease_duration.as_secs() as i32),
            acquire_time: Some(acquired.unwrap_or_else(now)),
            renew_time: Some(now()),
            lease_transitions: Some(transitions),
            ..Default::default()
        };
        let result = match lease {
            None => {
                let mut l = Lease::default();
                l.metadata.name = Some(self.cfg.name.clone());
                l.metadata.namespace = Some(self.cfg.namespace.clone());
                l.spec = Some(mine(0, None));
                self.api.create(&PostParams::default(), &l).await
            }
            Some(mut l) => {
                let spec = l.spec.clone().unwrap_or_default();
                let holder = spec.holder_identity.as_deref().unwrap_or("");
                let transitions = spec.lease_transitions.unwrap_or(0);
                if holder == self.cfg.identity {
                    l.spec = Some(mine(transitions, spec.acquire_time.clone()));
                } else if holder.is_empty() || self.expired(&spec) {
                    l.spec = Some(mine(transitions + 1, None));
                } else {
                    return Ok(false);
                }
                self.api
                    .replace(&self.cfg.name, &PostParams::default(), &l)
                    .await
            }
        };
        match result {
            Ok(_) => Ok(true),
            // Another candidate wrote first.
            Err(e) if is_conflict(&e) || matches!(&e, kube::Error::Api(s) if s.code == 409) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Waits until this replica is the leader.
    pub async fn acquire(&self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    tracing::info!(identity = %self.cfg.identity, lease = %self.cfg.name, "became the leader");
                    return;
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election: reading the Lease failed"),
            }
            tokio::time::sleep(self.cfg.retry_period).await;
        }
    }

    /// Renews the Lease until renewal fails for longer than the renew deadline; returns then.
    pub async fn hold(&self) {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.cfg.retry_period).await;
            match self.try_acquire_or_renew().await {
                Ok(true) => last_renewal = tokio::time::Instant::now(),
                Ok(false) => {
                    tracing::error!(identity = %self.cfg.identity, "leadership lost to another replica");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the leader Lease failed");
                    if last_renewal.elapsed() > self.cfg.renew_deadline {
                        tracing::error!("could not renew the leader Lease within the deadline");
                        return;
                    }
                }
            }
        }
    }

    /// Gives the Lease up (on clean shutdown) so that a follower takes over at once.
    pub async fn release(&self) {
        if let Ok(mut l) = self.api.get(&self.cfg.name).await {
            let spec = l.spec.get_or_insert_with(Default::default);
            if spec.holder_identity.as_deref() == Some(&self.cfg.identity) {
                spec.holder_identity = None;
                spec.lease_duration_seconds = Some(1);
                spec.renew_time = Some(now());
                let _ = self
                    .api
                    .replace(&self.cfg.name, &PostParams::default(), &l)
                    .await;
            }
        }
    }
}
