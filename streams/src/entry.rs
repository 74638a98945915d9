//! Stream entries as the protocol handles them.

use redis::Value;

/// The field that names an entry's event when one event may be added more
/// than once (a producer's retry, a replay): its idempotency token. Without
/// it the entry ID is the event.
pub const F_EVENT_ID: &str = "streamfleet.event-id";

/// One stream entry with its binary-safe fields and delivery count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub stream: String,
    pub id: String,
    pub fields: Vec<(String, Vec<u8>)>,
    /// Times delivered, this delivery included (1 on first read). A
    /// delivery that never started its handler (its worker died first, or
    /// handed it back) is not counted.
    pub deliveries: u64,
    /// Times the worker process died while this entry's handler ran
    /// (`started`): a worker runs such an entry alone, and dead-letters it
    /// as `crashed-worker` at the crash limit.
    pub crashes: u32,
}

impl Entry {
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
    }

    /// A field as UTF-8 text, if it is present and valid.
    pub fn field_str(&self, name: &str) -> Option<&str> {
        self.field(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The event this entry carries, its idempotency token: the
    /// [`F_EVENT_ID`] field when set (not empty), else the entry ID. Not the
    /// business key: two events of one order ("charged", then "refunded")
    /// share a key and are two events.
    pub fn event_id(&self) -> &str {
        self.field_str(F_EVENT_ID).filter(|e| !e.is_empty()).unwrap_or(&self.id)
    }
}

/// Converts a redis-rs stream entry map; values that are not strings are
/// rendered as their debug text rather than dropped.
pub fn fields_from_map(map: std::collections::HashMap<String, Value>) -> Vec<(String, Vec<u8>)> {
    let mut fields: Vec<(String, Vec<u8>)> = map
        .into_iter()
        .map(|(k, v)| {
            let bytes = match v {
                Value::BulkString(b) => b,
                Value::SimpleString(s) => s.into_bytes(),
                Value::Int(i) => i.to_string().into_bytes(),
                other => format!("{other:?}").into_bytes(),
            };
            (k, bytes)
        })
        .collect();
    fields.sort();
    fields
}
