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
    #[error(
        "the letter {id:?} could be in any of the pipeline's {streams} dead-letter streams: \
         name it as <dead-letter stream>@<ID>, as listings print it (e.g. {example}@{id})"
    )]
    AmbiguousId { id: String, streams: usize, example: String },
    #[error("{stream:?} is not one of this pipeline's dead-letter streams ({known})")]
    UnknownStream { stream: String, known: String },
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
    /// The dead-letter stream and ID of a letter as the user names it:
    /// `<stream>@<ID>` (an ID never holds `@`), or a bare ID when the
    /// pipeline has one dead-letter stream. A bare ID with several is
    /// refused, not looked for in each: one ID can exist in two shards'
    /// streams, and a replay or purge must take the one the user saw.
    pub fn locate(&self, named: &str) -> Result<(String, String)> {
        match named.rsplit_once('@') {
            Some((stream, id)) if self.streams.iter().any(|s| s == stream) => Ok((stream.into(), id.into())),
            Some((stream, _)) => {
                Err(Refusal::UnknownStream { stream: stream.into(), known: self.streams.join(", ") }.into())
            }
            None => match &self.streams[..] {
                [only] => Ok((only.clone(), named.into())),
                streams => Err(Refusal::AmbiguousId {
                    id: named.into(),
                    streams: streams.len(),
                    example: streams.first().cloned().unwrap_or_default(),
                }
                .into()),
            },
        }
    }

    /// How a letter is named to the user (listings, `show`, `--ids`):
    /// `<stream>@<ID>` when the pipeline has several dead-letter streams.
    fn letter(&self, stream: &str, letter: &dlq::DeadLetter, with_payload: bool) -> Letter {
        let reference = if self.streams.len() > 1 { format!("{stream}@{}", letter.id) } else { letter.id.clone() };
        Letter::of(stream, letter, reference, with_payload)
    }

    /// Up to `limit` letters after the cursor `after` (`stream@id` when the
    /// pipeline has shards, else the ID), reading at most `max_scanned`.
    pub async fn list(
        &mut self,
        filter: &Filter,
        after: Option<&str>,
        limit: usize,
        max_scanned: usize,
    ) -> Result<LetterList> {
        let (mut resume_stream, mut after) = match after.map(|a| a.rsplit_once('@')) {
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
            list.items.extend(page.letters.iter().map(|l| self.letter(stream, l, false)));
            if let Some(cursor) = page.next {
                list.continue_ = Some(if self.streams.len() > 1 { format!("{stream}@{cursor}") } else { cursor });
                break;
            }
        }
        Ok(list)
    }

    /// One letter, with its payload (the original fields) if asked.
    /// `named` as [`Self::locate`] takes it.
    pub async fn show(&mut self, named: &str, with_payload: bool) -> Result<Option<Letter>> {
        let (stream, id) = self.locate(named)?;
        let found = dlq::show(&mut self.conn, &stream, &id).await?;
        Ok(found.map(|letter| self.letter(&stream, &letter, with_payload)))
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
    /// there (IDs as [`Self::locate`] takes them, all located before any is read).
    async fn choose(&mut self, selection: &Selection, max: u64) -> Result<Vec<(String, Vec<String>)>> {
        let located = match selection {
            Selection::Ids(named) => named.iter().map(|n| self.locate(n)).collect::<Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        let mut chosen = Vec::new();
        let mut total = 0u64;
        for stream in &self.streams {
            let want = usize::try_from((max + 1).saturating_sub(total)).unwrap_or(usize::MAX);
            if want == 0 {
                break;
            }
            let ids: Vec<String> = match selection {
                Selection::Ids(_) => {
                    let mut there = Vec::new();
                    for (_, id) in located.iter().filter(|(s, _)| s == stream) {
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
