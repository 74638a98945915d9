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
/// dead-lettered nor replayed). [`fields_from_value`] unpacks it, so readers
/// see the original fields.
pub const F_PACKED_FIELDS: &str = "streamfleet.packed-fields";

/// More fields than this are written packed ([`F_PACKED_FIELDS`]).
pub const PACK_OVER_FIELDS: usize = 3_000;

/// Packs fields into one value: per field `<name length>:<name><value
/// length>:<value>`, binary-safe.
pub fn pack(fields: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.iter().map(|(k, v)| k.len() + v.len() + 16).sum());
    for (k, v) in fields {
        let k = name_bytes(k);
        out.extend_from_slice(format!("{}:", k.len()).as_bytes());
        out.extend_from_slice(&k);
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
        let name = field_name(take(&mut bytes)?.to_vec());
        fields.push((name, take(&mut bytes)?.to_vec()));
    }
    Some(fields)
}

/// An entry's fields: names, and values as bytes.
pub type Fields = Vec<(String, Vec<u8>)>;

/// Entries as read: ID and fields.
pub type RawEntries = Vec<(String, Fields)>;

/// One field's arguments to a write: name and value, as bytes.
pub type FieldArg<'a> = (std::borrow::Cow<'a, [u8]>, std::borrow::Cow<'a, [u8]>);

/// How a field name that is not UTF-8 is shown: this prefix, then its
/// bytes in hex. Stream field names are binary; an entry's fields are
/// text-named here, so one such name is carried this way (the handler sees
/// it so) and written back as its original bytes wherever the library
/// writes fields (a dead letter, a replay: [`field_args`], [`pack`]).
/// Outside `streamfleet.`, so a replay keeps it.
pub const RAW_NAME_PREFIX: &str = "streamfleet-raw-name:";

/// A field name as read: itself, or, when it is not UTF-8 (or starts with
/// [`RAW_NAME_PREFIX`] itself, so that [`name_bytes`] undoes exactly this),
/// [`RAW_NAME_PREFIX`] and its bytes in hex.
pub fn field_name(bytes: Vec<u8>) -> String {
    let hex = |b: &[u8]| format!("{RAW_NAME_PREFIX}{}", b.iter().map(|b| format!("{b:02x}")).collect::<String>());
    match String::from_utf8(bytes) {
        Ok(name) if name.starts_with(RAW_NAME_PREFIX) => hex(name.as_bytes()),
        Ok(name) => name,
        Err(e) => hex(e.as_bytes()),
    }
}

/// The bytes a field name stands for: its own, or the original bytes of a
/// name read as [`RAW_NAME_PREFIX`] and hex ([`field_name`]).
pub fn name_bytes(name: &str) -> std::borrow::Cow<'_, [u8]> {
    let raw = name.strip_prefix(RAW_NAME_PREFIX).filter(|hex| hex.len() % 2 == 0).and_then(|hex| {
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect::<Option<Vec<u8>>>()
    });
    match raw {
        Some(bytes) => std::borrow::Cow::Owned(bytes),
        None => std::borrow::Cow::Borrowed(name.as_bytes()),
    }
}

/// A field value as bytes; values that are not strings are rendered as
/// their debug text rather than dropped.
fn value_bytes(v: Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b,
        Value::SimpleString(s) => s.into_bytes(),
        Value::Int(i) => i.to_string().into_bytes(),
        other => format!("{other:?}").into_bytes(),
    }
}

/// Converts a redis-rs stream entry map; values that are not strings are
/// rendered as their debug text rather than dropped; packed fields
/// ([`F_PACKED_FIELDS`]) are unpacked.
pub fn fields_from_map(map: std::collections::HashMap<String, Value>) -> Vec<(String, Vec<u8>)> {
    finish_fields(map.into_iter().map(|(k, v)| (k, value_bytes(v))).collect())
}

/// An entry's fields from the `[name, value, ...]` list Redis sends, names
/// that are not UTF-8 included ([`field_name`]): where redis-rs's typed
/// replies refuse the whole reply for one such name, and one entry could
/// wedge every read, claim and sweep of its page.
pub fn fields_from_value(v: Value) -> Result<Vec<(String, Vec<u8>)>, redis::ParsingError> {
    let items = match v {
        Value::Array(items) => items,
        Value::Nil => Vec::new(),
        Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        other => return Err(not_entries(&other, "an entry's fields")),
    };
    if items.len() % 2 != 0 {
        return Err(redis::ParsingError::from("an odd number of field names and values"));
    }
    let mut fields = Vec::with_capacity(items.len() / 2);
    let mut items = items.into_iter();
    while let (Some(k), Some(v)) = (items.next(), items.next()) {
        let name = match k {
            Value::BulkString(b) => field_name(b),
            Value::SimpleString(s) => s,
            other => return Err(not_entries(&other, "a field name")),
        };
        fields.push((name, value_bytes(v)));
    }
    Ok(finish_fields(fields))
}

/// Stream entries as `XRANGE`, `XCLAIM` or one stream of `XREADGROUP`
/// send them (`[[ID, [name, value, ...]], ...]`): ID and fields each. An
/// entry sent as nil (deleted, by an older server) is skipped.
pub fn entries_from_value(v: Value) -> Result<RawEntries, redis::ParsingError> {
    let items = match v {
        Value::Array(items) => items,
        Value::Nil => return Ok(Vec::new()),
        other => return Err(not_entries(&other, "stream entries")),
    };
    let mut entries = Vec::with_capacity(items.len());
    for item in items {
        let mut parts = match item {
            Value::Nil => continue,
            Value::Array(parts) if parts.len() == 2 => parts.into_iter(),
            other => return Err(not_entries(&other, "a stream entry")),
        };
        let (Some(id), Some(fields)) = (parts.next(), parts.next()) else { continue };
        let id: String = redis::from_redis_value(id)?;
        entries.push((id, fields_from_value(fields)?));
    }
    Ok(entries)
}

/// An `XREADGROUP` reply: per stream, its entries ([`entries_from_value`]);
/// nothing for a nil reply (a block that timed out).
pub fn read_reply_from_value(v: Value) -> Result<Vec<(String, RawEntries)>, redis::ParsingError> {
    let streams: Vec<(Value, Value)> = match v {
        Value::Nil => return Ok(Vec::new()),
        Value::Map(pairs) => pairs,
        Value::Array(items) => items
            .into_iter()
            .map(|item| match item {
                Value::Array(pair) if pair.len() == 2 => {
                    let mut pair = pair.into_iter();
                    Ok((pair.next().unwrap_or(Value::Nil), pair.next().unwrap_or(Value::Nil)))
                }
                other => Err(not_entries(&other, "a stream of a read reply")),
            })
            .collect::<Result<_, _>>()?,
        other => return Err(not_entries(&other, "a read reply")),
    };
    streams
        .into_iter()
        .map(|(name, entries)| Ok((redis::from_redis_value(name)?, entries_from_value(entries)?)))
        .collect()
}

fn not_entries(v: &Value, what: &str) -> redis::ParsingError {
    redis::ParsingError::from(format!("expected {what}, got {v:?}"))
}

/// Unpacks packed fields ([`F_PACKED_FIELDS`]) and sorts.
fn finish_fields(mut fields: Vec<(String, Vec<u8>)>) -> Vec<(String, Vec<u8>)> {
    if let Some(at) = fields.iter().position(|(k, _)| k == F_PACKED_FIELDS)
        && let Some(unpacked) = unpack(&fields[at].1)
    {
        fields.swap_remove(at);
        fields.extend(unpacked);
    }
    fields.sort();
    fields
}

/// The arguments that write `fields` into an entry: as they are (a name
/// read as not UTF-8 as its original bytes, [`name_bytes`]), or packed
/// into one ([`F_PACKED_FIELDS`]) when there are more than [`PACK_OVER_FIELDS`].
pub fn field_args<'a>(fields: &[&'a (String, Vec<u8>)]) -> Vec<FieldArg<'a>> {
    use std::borrow::Cow;
    if fields.len() > PACK_OVER_FIELDS {
        let owned: Vec<(String, Vec<u8>)> = fields.iter().map(|f| (*f).clone()).collect();
        return vec![(Cow::Borrowed(F_PACKED_FIELDS.as_bytes()), Cow::Owned(pack(&owned)))];
    }
    fields.iter().map(|(k, v)| (name_bytes(k), Cow::Borrowed(v.as_slice()))).collect()
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
            (String::from_utf8(args[0].0.to_vec()).unwrap(), Value::BulkString(args[0].1.to_vec())),
            ("other".to_string(), Value::BulkString(b"o".to_vec())),
        ]);
        let read = fields_from_map(map);
        assert_eq!(read.len(), 5_001);
        assert_eq!(&read[..5_000], &fields[..]);
        let few = &refs[..3];
        assert_eq!(field_args(few).len(), 3, "a small entry is written as it is");
    }

    #[test]
    fn a_field_name_that_is_not_utf8_is_read_and_written_back_as_it_was() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::BulkString(b"1-0".to_vec()),
                Value::Array(vec![
                    Value::BulkString(b"order\xff".to_vec()),
                    Value::BulkString(b"7".to_vec()),
                    Value::BulkString(b"ok".to_vec()),
                    Value::BulkString(b"1".to_vec()),
                ]),
            ]),
            Value::Nil,
        ]);
        let entries = entries_from_value(reply).unwrap();
        let fields = &entries[0].1;
        assert_eq!(entries.len(), 1);
        assert_eq!(fields[0], ("ok".to_string(), b"1".to_vec()));
        assert_eq!(fields[1], (format!("{RAW_NAME_PREFIX}6f72646572ff"), b"7".to_vec()));
        let refs: Vec<&(String, Vec<u8>)> = fields.iter().collect();
        let args = field_args(&refs);
        assert_eq!(args[1].0.as_ref(), b"order\xff", "written back as its own bytes");
        assert_eq!(unpack(&pack(fields)), Some(fields.clone()), "and packed");
        // A text name that starts with the prefix itself goes the same way,
        // so reading and writing back are inverses for every name.
        for name in [format!("{RAW_NAME_PREFIX}6f6b"), format!("{RAW_NAME_PREFIX}zz"), RAW_NAME_PREFIX.to_string()] {
            let read = field_name(name.clone().into_bytes());
            assert_ne!(read, name);
            assert_eq!(name_bytes(&read).as_ref(), name.as_bytes(), "{name}");
        }
        assert_eq!(name_bytes("plain").as_ref(), b"plain");
        assert!(entries_from_value(Value::Array(vec![Value::Int(1)])).is_err());
        let read = Value::Array(vec![Value::Array(vec![
            Value::BulkString(b"orders".to_vec()),
            Value::Array(vec![Value::Array(vec![Value::BulkString(b"2-0".to_vec()), Value::Array(vec![])])]),
        ])]);
        assert_eq!(
            read_reply_from_value(read).unwrap(),
            vec![("orders".to_string(), vec![("2-0".to_string(), vec![])])]
        );
        assert_eq!(read_reply_from_value(Value::Nil).unwrap(), vec![]);
    }
}
