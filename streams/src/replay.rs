//! Replay: re-add dead letters to their source stream with their original
//! fields (business key included), addressed to the letter's group only
//! (`streamfleet.replay-for`; workers of other groups ack it unrun), and
//! remove them from the dead-letter stream, each in one script that first
//! checks the group's idempotency guard: an event completed since (by
//! another delivery) is not replayed, a dead consumer's `processing` lock is
//! cleared. The replay carries its event (`streamfleet.event-id`).

use crate::deadletter::{F_BUSINESS_KEY, F_GROUP, F_REASON, F_SOURCE_ID, F_SOURCE_STREAM, PREFIX};
use crate::entry::{F_EVENT_ID, entries_from_value};
use crate::error::StreamError;
use redis::aio::ConnectionLike;

/// Which dead letters to replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    Ids(Vec<String>),
    /// Inclusive ID range of the dead-letter stream (`-` and `+` allowed).
    Range {
        from: String,
        to: String,
    },
    All,
    /// Every letter the filter matches.
    Matching(crate::dlq::Filter),
}

/// What happened to one dead letter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Replayed {
    Requeued {
        dead_letter_id: String,
        source_stream: String,
        new_id: String,
        business_key: Option<String>,
    },
    /// Left in place, with why (no source stream, a payload-missing record, not found).
    Skipped {
        dead_letter_id: String,
        why: String,
    },
}

const PAGE: usize = 500;

/// The group a replayed entry is for; other groups' workers ack it unrun.
pub const F_REPLAY_FOR: &str = "streamfleet.replay-for";
/// The dead letter a replayed entry came from.
pub const F_REPLAY_OF: &str = "streamfleet.replay-of";

/// KEYS: source stream, dead-letter stream, guard lock, dead-consumer
/// registry, the event's completion record. ARGV: dead letter ID, '1' to
/// check the guard, then the new entry's fields and values. An event
/// completed since is not replayed. A `processing` lock is cleared only when
/// its owner was declared dead: a live holder's lock stands (the replay
/// waits). A letter no longer there (replayed or purged since it was read,
/// or this script run a second time by a client re-sending it) is not
/// requeued again. Returns {1, new ID}, or {0, why}.
static REPLAY: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        if #redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1]) == 0 then return {0, 'gone'} end
        if ARGV[2] == '1' then
            if redis.call('GET', KEYS[5]) == 'completed' then return {0, 'completed'} end
            local mark = redis.call('GET', KEYS[3])
            local owner = mark and string.match(mark, '^processing:([^:]+)')
            if owner and redis.call('ZSCORE', KEYS[4], owner) then redis.call('DEL', KEYS[3]) end
        end
        local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
        redis.call('XDEL', KEYS[2], ARGV[1])
        return {1, id}",
    )
});

pub async fn replay<C: ConnectionLike + Send>(
    conn: &mut C,
    dead_letter_stream: &str,
    selection: &Selection,
    dry_run: bool,
) -> Result<Vec<Replayed>, StreamError> {
    let letters = select(conn, dead_letter_stream, selection).await?;
    let mut out = Vec::with_capacity(letters.len());
    for (id, fields) in letters {
        let Some(fields) = fields else {
            out.push(Replayed::Skipped { dead_letter_id: id, why: "not found".into() });
            continue;
        };
        let text = |k: &str| fields.iter().find(|(f, _)| f == k).map(|(_, v)| String::from_utf8_lossy(v).into_owned());
        let Some(source) = text(F_SOURCE_STREAM) else {
            out.push(Replayed::Skipped {
                dead_letter_id: id,
                why: "no source stream: not a streamfleet dead letter".into(),
            });
            continue;
        };
        if source == dead_letter_stream {
            // Re-adding it here and deleting it would lose it.
            out.push(Replayed::Skipped {
                dead_letter_id: id,
                why: "its source is the dead-letter stream itself".into(),
            });
            continue;
        }
        if text(F_REASON).as_deref() == Some("payload-missing") {
            out.push(Replayed::Skipped { dead_letter_id: id, why: "payload-missing: nothing to replay".into() });
            continue;
        }
        if fields.iter().any(|(k, _)| k == crate::entry::F_PACKED_FIELDS) {
            // Still there: it did not unpack (`entry::entries_from_value`).
            // Replaying would requeue an entry without its fields.
            out.push(Replayed::Skipped { dead_letter_id: id, why: "its packed fields do not unpack".into() });
            continue;
        }
        let original: Vec<&(String, Vec<u8>)> = fields.iter().filter(|(k, _)| !k.starts_with(PREFIX)).collect();
        let business_key = text(F_BUSINESS_KEY);
        if dry_run {
            out.push(Replayed::Requeued {
                dead_letter_id: id,
                source_stream: source,
                new_id: "(dry run)".into(),
                business_key,
            });
            continue;
        }
        let group = text(F_GROUP);
        // The event the letter carried: its own event-ID field, or its source
        // entry ID. The replay carries it, so the worker knows it is that
        // event again, and completing either completes both.
        let event = text(F_EVENT_ID).filter(|e| !e.is_empty()).or_else(|| text(F_SOURCE_ID));
        // The guard lock the worker used: the business key, or the event.
        let token = business_key.clone().or_else(|| event.clone());
        let (lock, record) = match (&group, &token, &event) {
            (Some(group), Some(token), Some(event)) => (
                Some(crate::keys::guard_key(&source, group, token)),
                Some(crate::keys::completion_key(&source, group, event)),
            ),
            _ => (None, None),
        };
        let mut script = REPLAY.prepare_invoke();
        script
            .key(&source)
            .key(dead_letter_stream)
            .key(lock.clone().unwrap_or_else(|| source.clone()))
            .key(crate::keys::dead_consumers_key(&source, group.as_deref().unwrap_or_default()))
            .key(record.unwrap_or_else(|| source.clone()))
            .arg(&id)
            .arg(if lock.is_some() { "1" } else { "0" });
        // A huge entry goes back packed (a script passes at most ~8,000
        // arguments); readers unpack it (`entry::entries_from_value`).
        for (k, v) in crate::entry::field_args(&original) {
            script.arg(k.as_ref()).arg(v.as_ref());
        }
        if let Some(event) = &event {
            script.arg(F_EVENT_ID).arg(event);
        }
        if let Some(group) = &group {
            script.arg(F_REPLAY_FOR).arg(group).arg(F_REPLAY_OF).arg(&id);
        }
        let (done, detail): (u8, String) =
            script.invoke_async(conn).await.map_err(|e| StreamError::new("replaying a dead letter", e))?;
        if done == 0 && detail == "gone" {
            out.push(Replayed::Skipped {
                dead_letter_id: id,
                why: "no longer in the dead-letter stream: replayed or purged since it was read".into(),
            });
            continue;
        }
        if done == 0 {
            out.push(Replayed::Skipped {
                dead_letter_id: id,
                why: format!(
                    "its event is {detail} in group {:?}: another delivery did it after it was dead-lettered, \
                     so replaying would apply it twice",
                    group.unwrap_or_default()
                ),
            });
            continue;
        }
        let new_id = detail;
        out.push(Replayed::Requeued { dead_letter_id: id, source_stream: source, new_id, business_key });
    }
    Ok(out)
}

type Letter = (String, Option<Vec<(String, Vec<u8>)>>);

async fn select<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    selection: &Selection,
) -> Result<Vec<Letter>, StreamError> {
    let err = |e| StreamError::new("reading dead letters", e);
    let range = |from: String, to: String| (from, to);
    let filter = match selection {
        Selection::Matching(filter) => Some(filter),
        _ => None,
    };
    let (from, to) = match selection {
        Selection::Ids(ids) => {
            let mut pipe = redis::pipe();
            for id in ids {
                pipe.cmd("XRANGE").arg(stream).arg(id).arg(id);
            }
            let found: Vec<redis::Value> = pipe.query_async(conn).await.map_err(err)?;
            let mut out = Vec::with_capacity(ids.len());
            for (id, r) in ids.iter().zip(found) {
                let letter = entries_from_value(r).map_err(|e| err(e.into()))?.into_iter().next();
                out.push((id.clone(), letter.map(|(_, fields)| fields)));
            }
            return Ok(out);
        }
        Selection::Range { from, to } => range(from.clone(), to.clone()),
        Selection::All => range("-".into(), "+".into()),
        Selection::Matching(filter) => filter.scan_range(),
    };
    let mut out = Vec::new();
    let mut start = from;
    loop {
        let page: redis::Value = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&start)
            .arg(&to)
            .arg("COUNT")
            .arg(PAGE)
            .query_async(conn)
            .await
            .map_err(err)?;
        let page = entries_from_value(page).map_err(|e| err(e.into()))?;
        let n = page.len();
        let Some(last) = page.last().map(|(id, _)| id.clone()) else { break };
        for (id, fields) in page {
            if filter.is_none_or(|f| f.matches(&crate::dlq::DeadLetter::parse(id.clone(), fields.clone()))) {
                out.push((id, Some(fields)));
            }
        }
        if n < PAGE {
            break;
        }
        start = format!("({last}");
    }
    Ok(out)
}
