//! Kubernetes Events (`events.k8s.io/v1`) about the resources, with repeats
//! folded into a series. kube's `Recorder` folds by reason alone and keeps
//! the first note, so "2 payloads lost" would still read 2 after 50; here a
//! repeat is the same reason *and* note, and a new note is a new Event.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use std::collections::HashMap;
use tokio::sync::Mutex;

/// How long a published Event may be continued as a series.
const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);
/// Notes are cut to this many bytes (the API server caps them at 1 kB).
const NOTE_LIMIT: usize = 1000;

/// `note` cut at a character boundary to at most [`NOTE_LIMIT`] bytes.
fn bounded(note: &str) -> String {
    cut(note, NOTE_LIMIT)
}

/// `text` cut at a character boundary to at most `limit` bytes (a handler's
/// error quoted in a message or the status).
pub fn cut(text: &str, limit: usize) -> String {
    let mut end = text.len().min(limit);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    regarding: String,
    type_: EventType,
    reason: String,
    action: String,
    note: String,
}

struct Published {
    name: String,
    namespace: String,
    count: i32,
    last: Timestamp,
}

pub struct EventPublisher {
    client: Client,
    controller: String,
    instance: String,
    published: Mutex<HashMap<Key, Published>>,
}

impl EventPublisher {
    pub fn new(client: Client, controller: &str, instance: Option<String>) -> Self {
        let instance = instance.unwrap_or_else(|| controller.to_string());
        Self { client, controller: controller.into(), instance, published: Mutex::new(HashMap::new()) }
    }

    /// Counts one more in the series of an identical recent Event; false when
    /// there is none (or it is gone), so a new Event must be created. The
    /// lock is held only to read and update the record, never across an API
    /// call.
    async fn continue_series(&self, key: &Key, now: Timestamp) -> bool {
        let series = {
            let mut published = self.published.lock().await;
            published.retain(|_, p| now.duration_since(p.last) < SERIES_WINDOW);
            published.get_mut(key).map(|p| {
                p.count = p.count.saturating_add(1);
                p.last = now;
                (p.name.clone(), p.namespace.clone(), p.count)
            })
        };
        let Some((name, namespace, count)) = series else { return false };
        let series = EventSeries { count, last_observed_time: MicroTime(now) };
        let patch = serde_json::json!({ "series": series });
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        match events.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => true,
            // Gone (expired, deleted): start a new Event.
            Err(e) => {
                tracing::debug!(error = %e, "continuing an event series");
                self.published.lock().await.remove(key);
                false
            }
        }
    }

    /// Creates an Event about `regarding`, or counts one more in the series
    /// of an identical Event published within the last minutes.
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let note = bounded(note);
        let namespace = regarding.namespace.clone().unwrap_or_else(|| "default".into());
        let key = Key {
            regarding: regarding.uid.clone().unwrap_or_else(|| format!("{namespace}/{:?}", regarding.name)),
            type_,
            reason: reason.into(),
            action: action.into(),
            note: note.clone(),
        };
        if self.continue_series(&key, now).await {
            return Ok(());
        }
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let event = Event {
            metadata: ObjectMeta {
                // `<object>.<time in ns, hex>`, as kubectl and client-go name them.
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_deref().unwrap_or(&self.controller),
                    now.as_nanosecond()
                )),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(action.into()),
            reason: Some(reason.into()),
            note: Some(note),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(format!("{type_:?}")),
            ..Event::default()
        };
        let created = events.create(&PostParams::default(), &event).await?;
        let name = created.metadata.name.unwrap_or_default();
        self.published.lock().await.insert(key, Published { name, namespace, count: 1, last: now });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_to_the_byte_limit_at_a_character_boundary() {
        let long = "é".repeat(NOTE_LIMIT);
        let cut = bounded(&long);
        assert!(cut.len() <= NOTE_LIMIT && cut.len() >= NOTE_LIMIT - 1);
        assert!(cut.chars().all(|c| c == 'é'));
        assert_eq!(bounded("short"), "short");
    }
}
