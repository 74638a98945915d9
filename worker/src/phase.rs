//! One entry's life in a batch, as an explicit state machine: where it
//! stands ([`Phase`]), what may happen to it ([`Event`]), and what the hold
//! and the hand-back do with it in each phase. The transition function is
//! pure; [`PhaseCell`] applies it atomically, as the handlers, the flush,
//! the hold and the hand-back all look at an entry's phase concurrently.
//!
//! ```text
//!  Waiting ──Start──▶ Running ──EffectDone──▶ Done ──Committed──▶ Settled
//!                        │                                          ▲
//!                        ├──Leave──▶ Leaving ──Left─────────────────┤
//!                        └──Left────────────────────────────────────┘
//! ```
//!
//! "Done, not committed" and "never started" are phases, not guesses: a
//! done entry is never handed back (that would run its effect twice), one
//! never started is handed back without its delivery counting
//! (`streams::started`).

use std::sync::atomic::{AtomicU8, Ordering};

/// Where an entry of a batch stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Read (and its guard lock taken); its handler has not started.
    Waiting = 0,
    /// Being decided: its handler runs (or the guard said it is a duplicate,
    /// busy, or past its deliveries).
    Running = 1,
    /// Its effect is done and its commit (completion record and ack) not yet
    /// written: held and retried, never handed back.
    Done = 2,
    /// Leaving for redelivery (a failure) or to its dead letter: its lock is
    /// being released, so it is no longer held (a hold must not put the lock
    /// back) nor handed back.
    Leaving = 3,
    /// Committed, or left pending / dead-lettered for good: nothing more to do.
    Settled = 4,
}

/// What happens to an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Its turn came: the handler (or the guard's verdict) starts.
    Start,
    /// Its handler's effect happened (or it is a duplicate to ack): commit it.
    EffectDone,
    /// It leaves the batch: its lock is released now.
    Leave,
    /// It was left pending or dead-lettered: nothing more to do here.
    Left,
    /// Its completion and ack were written.
    Committed,
}

/// What the hand-back at the end of a batch does with an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandBack {
    /// Handed back claimable at once; its next claim does not count the
    /// delivery (its handler never started).
    NotStarted,
    /// Handed back claimable at once while its handler still ran (the drain
    /// deadline): its next claim counts the delivery, as a crash.
    Abandoned,
    /// Kept as it is, mark and all: its effect happened (never re-run early).
    Keep,
    /// Nothing: it already left.
    Nothing,
}

impl Phase {
    /// The phase `event` leads to, or `None` when it cannot happen here (a
    /// defect in the caller).
    pub fn next(self, event: Event) -> Option<Phase> {
        use {Event::*, Phase::*};
        match (self, event) {
            (Waiting, Start) => Some(Running),
            (Running, EffectDone) => Some(Done),
            (Running, Leave) => Some(Leaving),
            (Running | Leaving, Left) => Some(Settled),
            (Done, Committed) => Some(Settled),
            _ => None,
        }
    }

    /// Whether the hold renews the entry (its idle time and guard lock).
    pub fn is_held(self) -> bool {
        matches!(self, Phase::Waiting | Phase::Running | Phase::Done)
    }

    /// What the hand-back does with an entry the batch leaves in this phase.
    pub fn hand_back(self) -> HandBack {
        match self {
            Phase::Waiting => HandBack::NotStarted,
            Phase::Running => HandBack::Abandoned,
            Phase::Done => HandBack::Keep,
            Phase::Leaving | Phase::Settled => HandBack::Nothing,
        }
    }

    fn from_u8(value: u8) -> Phase {
        match value {
            0 => Phase::Waiting,
            1 => Phase::Running,
            2 => Phase::Done,
            3 => Phase::Leaving,
            _ => Phase::Settled,
        }
    }
}

/// An entry's phase, shared by the tasks of its batch.
#[derive(Debug)]
pub struct PhaseCell(AtomicU8);

impl Default for PhaseCell {
    fn default() -> Self {
        Self(AtomicU8::new(Phase::Waiting as u8))
    }
}

impl PhaseCell {
    pub fn get(&self) -> Phase {
        Phase::from_u8(self.0.load(Ordering::SeqCst))
    }

    /// Applies `event` atomically. An event that cannot happen in the
    /// current phase changes nothing and returns that phase as the error.
    pub fn apply(&self, event: Event) -> Result<Phase, Phase> {
        let mut current = self.get();
        loop {
            let next = current.next(event).ok_or(current)?;
            match self.0.compare_exchange(current as u8, next as u8, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Ok(next),
                Err(actual) => current = Phase::from_u8(actual),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Event::*;
    use Phase::*;

    const PHASES: [Phase; 5] = [Waiting, Running, Done, Leaving, Settled];
    const EVENTS: [Event; 5] = [Start, EffectDone, Leave, Left, Committed];

    #[test]
    fn every_legal_transition_and_nothing_else() {
        let legal = [
            (Waiting, Start, Running),
            (Running, EffectDone, Done),
            (Running, Leave, Leaving),
            (Running, Left, Settled),
            (Leaving, Left, Settled),
            (Done, Committed, Settled),
        ];
        for phase in PHASES {
            for event in EVENTS {
                let expected = legal.iter().find(|(p, e, _)| *p == phase && *e == event).map(|(_, _, n)| *n);
                assert_eq!(phase.next(event), expected, "{phase:?} on {event:?}");
            }
        }
    }

    #[test]
    fn done_work_is_never_handed_back_and_a_never_started_entry_does_not_count() {
        assert_eq!(Done.hand_back(), HandBack::Keep);
        assert_eq!(Waiting.hand_back(), HandBack::NotStarted);
        assert_eq!(Running.hand_back(), HandBack::Abandoned);
        assert_eq!((Leaving.hand_back(), Settled.hand_back()), (HandBack::Nothing, HandBack::Nothing));
    }

    #[test]
    fn the_hold_keeps_what_is_in_hand_and_lets_go_of_what_leaves() {
        let held: Vec<Phase> = PHASES.into_iter().filter(|p| p.is_held()).collect();
        assert_eq!(held, vec![Waiting, Running, Done]);
    }

    #[test]
    fn a_cell_applies_legal_events_and_refuses_others_unchanged() {
        let cell = PhaseCell::default();
        assert_eq!(cell.apply(EffectDone), Err(Waiting));
        assert_eq!(cell.apply(Start), Ok(Running));
        assert_eq!(cell.apply(EffectDone), Ok(Done));
        assert_eq!(cell.apply(Leave), Err(Done), "done work never leaves unrecorded");
        assert_eq!(cell.apply(Committed), Ok(Settled));
        assert_eq!(cell.get(), Settled);
        for phase in PHASES {
            assert_eq!(Phase::from_u8(phase as u8), phase);
        }
    }
}
