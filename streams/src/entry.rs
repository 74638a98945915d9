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

/// The field that carries an entry's own fields packed into one value
/// ([`pack`]), in a dead letter or a replay of an entry with more fields
/// than a Lua script can pass to one command (Redis's Lua stops at about
/// 8,000 arguments: an entry of 4,000 fields could otherwise never be
/// dead-lettered nor replayed). [`fields_from_map`] unpacks it, so readers
/// see the original fields.
pub const F_PACKED_FIELDS: &str = "streamfleet.packed-fields";

/// More fields than this are written packed ([`F_PACKED_FIELDS`]).
pub const PACK_OVER_FIELDS: usize = 3_000;

/// Packs fields into one value: per field `<name length>:<name><value
/// length>:<value>`, binary-safe.
pub fn pack(fields: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.iter().map(|(k, v)| k.len() + v.len() + 16).sum());
    for (k, v) in fields {
        out.extend_from_slice(format!("{}:", k.len()).as_bytes());
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(format!("{}:", v.len()).as_bytes());
        out.extend_from_slice(v);
    }
    out
}

/// The fields [`pack`] packed; `None` when `bytes` is not such a value
/// (an empty one included: a packed entry has at least one field).
pub fn unpack(mut bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if bytes.is_empty() {
        return None;
    }
    fn take<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
        let colon = bytes.iter().position(|b| *b == b':')?;
        let len: usize = std::str::from_utf8(&bytes[..colon]).ok()?.parse().ok()?;
        let rest = &bytes[colon + 1..];
        let (value, after) = (rest.get(..len)?, rest.get(len..)?);
        *bytes = after;
        Some(value)
    }
    let mut fields = Vec::new();
    while !bytes.is_empty() {
        let name = String::from_utf8(take(&mut bytes)?.to_vec()).ok()?;
        fields.push((name, take(&mut bytes)?.to_vec()));
    }
    Some(fields)
}

/// Converts a redis-rs stream entry map; values that are not strings are
/// rendered as their debug text rather than dropped; packed fields
/// ([`F_PACKED_FIELDS`]) are unpacked.
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
    if let Some(at) = fields.iter().position(|(k, _)| k == F_PACKED_FIELDS)
        && let Some(unpacked) = unpack(&fields[at].1)
    {
        fields.swap_remove(at);
        fields.extend(unpacked);
    }
    fields.sort();
    fields
}

/// The arguments that write `fields` into an entry: as they are, or packed
/// into one ([`F_PACKED_FIELDS`]) when there are more than [`PACK_OVER_FIELDS`].
pub fn field_args<'a>(
    fields: &[&'a (String, Vec<u8>)],
) -> Vec<(std::borrow::Cow<'a, str>, std::borrow::Cow<'a, [u8]>)> {
    use std::borrow::Cow;
    if fields.len() > PACK_OVER_FIELDS {
        let owned: Vec<(String, Vec<u8>)> = fields.iter().map(|f| (*f).clone()).collect();
        return vec![(Cow::Borrowed(F_PACKED_FIELDS), Cow::Owned(pack(&owned)))];
    }
    fields.iter().map(|(k, v)| (Cow::Borrowed(k.as_str()), Cow::Borrowed(v.as_slice()))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_fields_come_back_as_they_were() {
        let fields = vec![
            ("a".to_string(), b"1".to_vec()),
            ("with:colon".to_string(), b"x:y\0z".to_vec()),
            (String::new(), Vec::new()),
            ("12".to_string(), b"34:".to_vec()),
        ];
        assert_eq!(unpack(&pack(&fields)), Some(fields));
        assert_eq!(unpack(b"3:ab"), None, "a short value is no packed value");
        assert_eq!(unpack(b"x:ab"), None);
        assert_eq!(unpack(b""), None, "an empty value is a field of its own, not no fields");
    }

    #[test]
    fn a_huge_entry_is_written_packed_and_read_unpacked() {
        let fields: Vec<(String, Vec<u8>)> = (0..5_000).map(|i| (format!("f{i:05}"), vec![b'v'; 3])).collect();
        let refs: Vec<&(String, Vec<u8>)> = fields.iter().collect();
        let args = field_args(&refs);
        assert_eq!(args.len(), 1);
        let map = std::collections::HashMap::from([
            (args[0].0.to_string(), Value::BulkString(args[0].1.to_vec())),
            ("other".to_string(), Value::BulkString(b"o".to_vec())),
        ]);
        let read = fields_from_map(map);
        assert_eq!(read.len(), 5_001);
        assert_eq!(&read[..5_000], &fields[..]);
        let few = &refs[..3];
        assert_eq!(field_args(few).len(), 3, "a small entry is written as it is");
    }
}
