//! Events about the objects a reconciler handles. Recording one is best effort: a failure is
//! logged and never fails the reconcile that had something to say.

use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};

/// A component's Event recorder (`reportingController` / `reportingInstance`).
pub struct EventSink {
    recorder: Recorder,
}

impl EventSink {
    pub fn new(client: Client, controller: &str, instance: Option<String>) -> EventSink {
        let reporter = Reporter {
            controller: controller.into(),
            instance,
        };
        EventSink {
            recorder: Recorder::new(client, reporter),
        }
    }

    /// Publishes `ev` about `obj`.
    pub async fn publish<K: Resource<DynamicType = ()>>(&self, obj: &K, ev: Event) {
        if let Err(e) = self.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::warn!(object = %obj.name_any(), error = %e, "recording an event failed");
        }
    }
}

/// A Normal or Warning Event with `reason`, about `action`. Set `secondary` to name a second
/// object it concerns (the recorder aggregates Events per object pair, so Events about
/// different related objects stay apart).
pub fn event(warning: bool, reason: &str, action: &str, note: String) -> Event {
    Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        note: Some(note),
        action: action.into(),
        secondary: None,
    }
}
