//! A pipeline's dead letters across its shards (one dead-letter stream per
//! shard): pages, one letter, counts, replay and purge, as the console API
//! and the CLI's break-glass mode both do them.

use super::wire::{
    ActionRequest, ActionResult, DEFAULT_ACTION_CAP, Letter, LetterList, LetterStats, Requeued, Selector, Skipped,
    rfc3339,
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
    #[error("{matched} letters chosen, more than the cap of {max}: narrow the selection, or raise max to {matched}")]
    OverCap { matched: u64, max: u64 },
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

    /// One letter in full, payload included.
    pub async fn show(&mut self, id: &str) -> Result<Option<Letter>> {
        for stream in &self.streams {
            if let Some(letter) = dlq::show(&mut self.conn, stream, id).await? {
                return Ok(Some(Letter::of(stream, &letter, true)));
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

    /// Replays or purges the chosen letters; a dry run counts them. Refused
    /// without a selection, and when more are chosen than `max`.
    pub async fn act(&mut self, action: Action, request: &ActionRequest) -> Result<ActionResult> {
        let selection = selection(&request.selector)?;
        let max = request.max.unwrap_or(DEFAULT_ACTION_CAP);
        let mut result = ActionResult { dry_run: request.dry_run, ..ActionResult::default() };
        match action {
            Action::Replay => {
                // Count first (a dry run reads, writes nothing): the cap
                // holds before anything is requeued.
                let mut counted = 0;
                for stream in &self.streams {
                    counted += replay(&mut self.conn, stream, &selection, true).await?.len() as u64;
                }
                if counted > max {
                    return Err(Refusal::OverCap { matched: counted, max }.into());
                }
                for stream in &self.streams {
                    for r in replay(&mut self.conn, stream, &selection, request.dry_run).await? {
                        result.matched += 1;
                        match r {
                            Replayed::Requeued { dead_letter_id, source_stream, new_id, business_key } => {
                                result.done += 1;
                                result.requeued.push(Requeued { dead_letter_id, source_stream, new_id, business_key });
                            }
                            Replayed::Skipped { dead_letter_id, why } => {
                                result.skipped.push(Skipped { dead_letter_id, why })
                            }
                        }
                    }
                }
            }
            Action::Purge => {
                let mut chosen = Vec::new();
                for stream in &self.streams {
                    let ids: Vec<String> = match &selection {
                        Selection::Ids(ids) => {
                            let mut there = Vec::new();
                            for id in ids {
                                if dlq::show(&mut self.conn, stream, id).await?.is_some() {
                                    there.push(id.clone());
                                }
                            }
                            there
                        }
                        Selection::Matching(filter) => {
                            dlq::all(&mut self.conn, stream, filter).await?.into_iter().map(|l| l.id).collect()
                        }
                        _ => dlq::all(&mut self.conn, stream, &Filter::default())
                            .await?
                            .into_iter()
                            .map(|l| l.id)
                            .collect(),
                    };
                    chosen.push((stream.clone(), ids));
                }
                result.matched = chosen.iter().map(|(_, ids)| ids.len() as u64).sum();
                if result.matched > max {
                    return Err(Refusal::OverCap { matched: result.matched, max }.into());
                }
                for (stream, ids) in &chosen {
                    result.done += if request.dry_run {
                        ids.len() as u64
                    } else {
                        dlq::purge(&mut self.conn, stream, ids).await?
                    };
                }
            }
        }
        Ok(result)
    }
}

/// Never everything by default: IDs, a filter, or `all` said outright.
pub fn selection(selector: &Selector) -> Result<Selection> {
    let filter = filter_of(&selector.filter)?;
    Ok(if !selector.ids.is_empty() {
        Selection::Ids(selector.ids.clone())
    } else if filter != Filter::default() {
        Selection::Matching(filter)
    } else if selector.all {
        Selection::All
    } else {
        return Err(Refusal::NoSelection.into());
    })
}
