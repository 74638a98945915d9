//! A pipeline's dead letters across its shards (one dead-letter stream per
//! shard): pages, one letter, counts, replay and purge, as the console API
//! and the CLI's break-glass mode both do them.

use super::wire::{
    ActionRequest, ActionResult, DEFAULT_ACTION_CAP, Letter, LetterList, LetterStats, Requeued, Skipped, rfc3339,
};
use anyhow::Result;
use streamfleet_streams::StreamConnection;
use streamfleet_streams::dlq::{self, Filter, Stats};
use streamfleet_streams::replay::{Replayed, Selection, replay};

/// Letters read at most for one page or one count: a view never reads a
/// whole long stream.
pub const VIEW_SCAN_LIMIT: usize = 10_000;

/// An action the caller must change before it can run.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("say which letters: ids, a filter, or all")]
    NoSelection,
    #[error("say which letters one way: ids, a filter, or all, not two of them")]
    TwoSelections,
    #[error(
        "more letters chosen than the cap of {max}: narrow the selection, or raise max (a dry run counts up to it)"
    )]
    OverCap { max: u64 },
    #[error("{0}")]
    BadFilter(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Replay,
    Purge,
}

pub struct Letters {
    pub conn: StreamConnection,
    /// The pipeline's dead-letter streams, shard 0 first.
    pub streams: Vec<String>,
}

fn filter_of(selector_filter: &super::wire::FilterSpec) -> Result<Filter> {
    selector_filter.filter().map_err(|e| Refusal::BadFilter(format!("{e:#}")).into())
}

impl Letters {
    /// Up to `limit` letters after the cursor `after` (`stream@id` when the
    /// pipeline has shards, else the ID), reading at most `max_scanned`.
    pub async fn list(
        &mut self,
        filter: &Filter,
        after: Option<&str>,
        limit: usize,
        max_scanned: usize,
    ) -> Result<LetterList> {
        let (mut resume_stream, mut after) = match after.map(|a| a.split_once('@')) {
            Some(Some((stream, id))) => (Some(stream.to_string()), Some(id.to_string())),
            Some(None) => (None, after.map(String::from)),
            None => (None, None),
        };
        let mut list = LetterList::default();
        let mut left = limit.max(1);
        for stream in &self.streams {
            if resume_stream.as_ref().is_some_and(|s| s != stream) {
                continue;
            }
            resume_stream = None;
            let page =
                dlq::page_bounded(&mut self.conn, stream, filter, after.take().as_deref(), left, max_scanned).await?;
            left -= page.letters.len();
            list.items.extend(page.letters.iter().map(|l| Letter::of(stream, l, false)));
            if let Some(cursor) = page.next {
                list.continue_ = Some(if self.streams.len() > 1 { format!("{stream}@{cursor}") } else { cursor });
                break;
            }
        }
        Ok(list)
    }

    /// One letter, with its payload (the original fields) if asked.
    pub async fn show(&mut self, id: &str, with_payload: bool) -> Result<Option<Letter>> {
        for stream in &self.streams {
            if let Some(letter) = dlq::show(&mut self.conn, stream, id).await? {
                return Ok(Some(Letter::of(stream, &letter, with_payload)));
            }
        }
        Ok(None)
    }

    /// Counts by reason, hour and error signature, over at most
    /// `max_scanned` letters per stream.
    pub async fn stats(&mut self, filter: &Filter, max_scanned: usize) -> Result<LetterStats> {
        let mut stats = Stats::default();
        let mut complete = true;
        for stream in &self.streams {
            let page = dlq::page_bounded(&mut self.conn, stream, filter, None, usize::MAX, max_scanned).await?;
            complete &= page.next.is_none();
            for l in &page.letters {
                stats.add(l);
            }
        }
        Ok(LetterStats {
            total: stats.total,
            by_reason: stats.by_reason,
            by_hour: stats.by_hour.into_iter().map(|(h, n)| (rfc3339(h), n)).collect(),
            by_error: stats.by_signature,
            complete,
        })
    }

    /// The chosen letters, per stream: at most `max + 1` in all (one more
    /// than the cap says "too many" without reading on), each one that is
    /// there (an ID is looked for in every shard's stream).
    async fn choose(&mut self, selection: &Selection, max: u64) -> Result<Vec<(String, Vec<String>)>> {
        let mut chosen = Vec::new();
        let mut total = 0u64;
        for stream in &self.streams {
            let want = usize::try_from((max + 1).saturating_sub(total)).unwrap_or(usize::MAX);
            if want == 0 {
                break;
            }
            let ids: Vec<String> = match selection {
                Selection::Ids(ids) => {
                    let mut there = Vec::new();
                    for id in ids {
                        if there.len() < want && dlq::show(&mut self.conn, stream, id).await?.is_some() {
                            there.push(id.clone());
                        }
                    }
                    there
                }
                Selection::Matching(filter) => dlq::page(&mut self.conn, stream, filter, None, want)
                    .await?
                    .letters
                    .into_iter()
                    .map(|l| l.id)
                    .collect(),
                _ => dlq::page(&mut self.conn, stream, &Filter::default(), None, want)
                    .await?
                    .letters
                    .into_iter()
                    .map(|l| l.id)
                    .collect(),
            };
            total += ids.len() as u64;
            chosen.push((stream.clone(), ids));
        }
        Ok(chosen)
    }

    /// Replays or purges the chosen letters; a dry run counts them. Refused
    /// (nothing done) without one selection, and when more than `max` are
    /// chosen. The letters counted are the ones acted on: letters added
    /// meanwhile are not taken. On an error part way, what was done so far
    /// comes back with it.
    pub async fn act(&mut self, action: Action, request: &ActionRequest) -> Result<ActionResult, Interrupted> {
        let mut result = ActionResult { dry_run: request.dry_run, ..ActionResult::default() };
        let refused = |error: anyhow::Error| Interrupted { result: ActionResult::default(), error };
        let selection = selection(request).map_err(refused)?;
        let max = request.max.unwrap_or(DEFAULT_ACTION_CAP);
        let chosen = self.choose(&selection, max).await.map_err(refused)?;
        result.matched = chosen.iter().map(|(_, ids)| ids.len() as u64).sum();
        if result.matched > max {
            return Err(refused(Refusal::OverCap { max }.into()));
        }
        for (stream, ids) in chosen {
            if ids.is_empty() {
                continue;
            }
            let step = match action {
                Action::Replay => {
                    replay(&mut self.conn, &stream, &Selection::Ids(ids), request.dry_run).await.map(|done| {
                        for r in done {
                            match r {
                                Replayed::Requeued { dead_letter_id, source_stream, new_id, business_key } => {
                                    result.done += 1;
                                    result.requeued.push(Requeued {
                                        dead_letter_id,
                                        source_stream,
                                        new_id,
                                        business_key,
                                    });
                                }
                                Replayed::Skipped { dead_letter_id, why } => {
                                    result.skipped.push(Skipped { dead_letter_id, why })
                                }
                            }
                        }
                    })
                }
                Action::Purge if request.dry_run => {
                    result.done += ids.len() as u64;
                    Ok(())
                }
                Action::Purge => dlq::purge(&mut self.conn, &stream, &ids).await.map(|n| result.done += n),
            };
            if let Err(e) = step {
                return Err(Interrupted { result, error: e.into() });
            }
        }
        Ok(result)
    }
}

/// An action that stopped: refused before it began (nothing done), or
/// failed part way (`result` says what was done).
#[derive(Debug)]
pub struct Interrupted {
    pub result: ActionResult,
    pub error: anyhow::Error,
}

/// Never everything by default: IDs, a filter, or `all` said outright,
/// and only one of them (IDs with a filter would act on the IDs whatever
/// the filter says).
pub fn selection(request: &ActionRequest) -> Result<Selection> {
    let filter = filter_of(&request.filter)?;
    let filtered = filter != Filter::default();
    match (!request.ids.is_empty(), filtered, request.all) {
        (true, false, false) => Ok(Selection::Ids(request.ids.clone())),
        (false, true, false) => Ok(Selection::Matching(filter)),
        (false, false, true) => Ok(Selection::All),
        (false, false, false) => Err(Refusal::NoSelection.into()),
        _ => Err(Refusal::TwoSelections.into()),
    }
}
