//! The cluster-wide settings as they are now: a component's own defaults with the KubeVirt
//! CR's `spec.configuration` over them (`api::kubevirt::ClusterSettings`), followed live. A
//! change to the CR reaches every reader within a watch event, with no restart; an edit that
//! cannot be taken is logged and the last valid settings stay; while no KubeVirt CR exists (or
//! its CRD is not installed, as when a component runs alone) the defaults hold.

use std::sync::Arc;

use api::kubevirt::{ClusterSettings, KubeVirt};
use futures::StreamExt;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;

/// A handle on the live settings; cheap to clone.
#[derive(Clone)]
pub struct LiveSettings {
    rx: watch::Receiver<Arc<ClusterSettings>>,
    /// The sender of fixed settings, kept so the channel stays open.
    _fixed: Option<Arc<watch::Sender<Arc<ClusterSettings>>>>,
}

impl LiveSettings {
    /// Settings that never change (a component run alone, unit tests).
    pub fn fixed(settings: ClusterSettings) -> LiveSettings {
        let (tx, rx) = watch::channel(Arc::new(settings));
        LiveSettings {
            rx,
            _fixed: Some(Arc::new(tx)),
        }
    }

    /// `defaults`, followed by the KubeVirt CR from now on (a task on the current runtime).
    pub fn follow(client: Client, defaults: ClusterSettings) -> LiveSettings {
        let (tx, rx) = watch::channel(Arc::new(defaults.clone()));
        tokio::spawn(follow(client, defaults, tx));
        LiveSettings { rx, _fixed: None }
    }

    /// The settings in force.
    pub fn current(&self) -> Arc<ClusterSettings> {
        self.rx.borrow().clone()
    }

    /// Waits for the next change (tests and servers that rebuild state on change).
    pub async fn changed(&mut self) -> Arc<ClusterSettings> {
        let _ = self.rx.changed().await;
        self.current()
    }
}

async fn follow(
    client: Client,
    defaults: ClusterSettings,
    tx: watch::Sender<Arc<ClusterSettings>>,
) {
    let (store, writer) = reflector::store::<KubeVirt>();
    let events = watcher(Api::<KubeVirt>::all(client), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    futures::pin_mut!(events);
    // The resourceVersion last applied (or refused), so a resync repeats nothing.
    let mut seen: Option<String> = None;
    while let Some(event) = events.next().await {
        if let Err(e) = event {
            // A cluster without the KubeVirt CRD answers 404 here, forever: the defaults hold.
            tracing::debug!(error = %e, "watching KubeVirt CRs");
            continue;
        }
        let all = store.state();
        let all: Vec<KubeVirt> = all.iter().map(|k| (**k).clone()).collect();
        let Some(active) = ClusterSettings::active(&all) else {
            if seen.take().is_some() {
                tx.send_replace(Arc::new(defaults.clone()));
            }
            continue;
        };
        if seen == active.resource_version() {
            continue;
        }
        seen = active.resource_version();
        let config = active.spec.configuration.clone().unwrap_or_default();
        match defaults.with(&config) {
            Ok(s) => {
                if **tx.borrow() != s {
                    tracing::info!(kubevirt = %active.name_any(), "cluster settings changed");
                    tx.send_replace(Arc::new(s));
                }
            }
            Err(why) => tracing::warn!(
                kubevirt = %active.name_any(),
                "{why}; keeping the settings in force"
            ),
        }
    }
}
