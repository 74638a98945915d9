//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several
//! operator replicas exactly one writes.
//!
//! Expiry is judged on this replica's own monotonic clock, never by comparing
//! another replica's `renewTime` with the local wall clock (which clock skew
//! would defeat). As in client-go and kubert: a standby remembers when it last
//! saw the lease record change (holder, `renewTime`, resourceVersion) and may
//! take the lease over only once the record has stayed unchanged for a whole
//! lease duration, measured locally since then. The leader stops leading when
//! it has not renewed within the renew deadline (2/3 of the duration) counted
//! from *before* its last successful write, so it has stepped down before any
//! standby can judge the lease expired. Every write is a compare-and-swap on
//! the Lease's resourceVersion (create, or replace of the object as read).
//!
//! [`decide`] is the whole decision, a pure function of what was observed and
//! when; [`LeaseLock`] does the reads and writes around it.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use std::time::Duration;
use tokio::time::Instant;

/// How often a standby retries, and a leader renews.
const RETRY: Duration = Duration::from_secs(2);

/// What of a Lease the decision looks at. Any difference between two reads
/// counts as a change, i.e. as a sign of life of its holder.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The holder; `None` when unset or empty (a free or released lease).
    pub holder: Option<String>,
    /// The holder's wall-clock renewal time: compared only for change, never
    /// with our clock.
    pub renew_time: Option<MicroTime>,
    pub resource_version: Option<String>,
    /// The duration the holder declared.
    pub lease_duration: Option<Duration>,
}

impl Record {
    pub fn of(lease: &Lease) -> Self {
        let spec = lease.spec.as_ref();
        Self {
            holder: spec.and_then(|s| s.holder_identity.clone()).filter(|h| !h.is_empty()),
            renew_time: spec.and_then(|s| s.renew_time.clone()),
            resource_version: lease.metadata.resource_version.clone(),
            lease_duration: spec
                .and_then(|s| s.lease_duration_seconds)
                .and_then(|s| u64::try_from(s).ok())
                .map(Duration::from_secs),
        }
    }
}

/// What this replica knows of the lease, with local monotonic times.
#[derive(Clone, Debug)]
pub struct Observed {
    /// The lease as last read; `None` while there is no Lease.
    pub record: Option<Record>,
    /// When the record was last seen to change.
    pub changed_at: Instant,
    /// While we lead: when the request of our last successful write was sent.
    pub renewed_at: Option<Instant>,
}

impl Observed {
    pub fn new(now: Instant) -> Self {
        Self { record: None, changed_at: now, renewed_at: None }
    }

    /// Takes in a read of the lease made at `now`; the change clock restarts
    /// only when the record differs from the previous read.
    pub fn observe(&mut self, record: Option<Record>, now: Instant) {
        if record != self.record {
            self.record = record;
            self.changed_at = now;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The lease is absent, free, released, ours from an earlier run, or
    /// expired: claim it.
    Acquire,
    /// We lead and the lease still names us: renew it.
    Renew,
    /// Another replica holds a live lease: wait.
    Wait,
    /// We were leading and no longer may: stop acting as leader at once.
    Lost,
}

/// How long after its last renewal was sent a leader may go on leading.
pub fn renew_deadline(lease_duration: Duration) -> Duration {
    lease_duration * 2 / 3
}

/// The election step for identity `me` at local time `now`, `lease_duration`
/// being our configured duration. Only local [`Instant`]s are compared; the
/// holder's `renewTime` matters only in that its changes restart
/// `observed.changed_at`.
pub fn decide(observed: &Observed, now: Instant, me: &str, lease_duration: Duration) -> Decision {
    let holder = observed.record.as_ref().and_then(|r| r.holder.as_deref());
    if let Some(renewed_at) = observed.renewed_at {
        if holder != Some(me) || now.saturating_duration_since(renewed_at) >= renew_deadline(lease_duration) {
            return Decision::Lost;
        }
        return Decision::Renew;
    }
    match holder {
        // Free or released; or named after us by a run of ours that has
        // ended (the pod's container restarted), which no longer writes.
        None => Decision::Acquire,
        Some(holder) if holder == me => Decision::Acquire,
        Some(_) => {
            // Honour a longer duration the holder declared.
            let declared = observed.record.as_ref().and_then(|r| r.lease_duration).unwrap_or_default();
            if now.saturating_duration_since(observed.changed_at) >= lease_duration.max(declared) {
                Decision::Acquire
            } else {
                Decision::Wait
            }
        }
    }
}

/// The Lease to write to acquire or renew `current` (`None`: create it) as
/// `me`. It keeps `current`'s resourceVersion, so replacing it is a
/// compare-and-swap.
fn claimed(current: Option<Lease>, name: &str, me: &str, now: Timestamp, lease_duration: Duration) -> Lease {
    let seconds = i32::try_from(lease_duration.as_secs()).unwrap_or(i32::MAX);
    let Some(mut lease) = current else {
        return Lease {
            metadata: ObjectMeta { name: Some(name.to_string()), ..ObjectMeta::default() },
            spec: Some(LeaseSpec {
                holder_identity: Some(me.to_string()),
                lease_duration_seconds: Some(seconds),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(me) {
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        spec.holder_identity = Some(me.to_string());
        spec.acquire_time = Some(MicroTime(now));
    }
    spec.renew_time = Some(MicroTime(now));
    spec.lease_duration_seconds = Some(seconds);
    lease
}

/// `lease` given up by `me`, or `None` when it is not ours to give up.
fn released(mut lease: Lease, me: &str) -> Option<Lease> {
    let spec = lease.spec.as_mut()?;
    if spec.holder_identity.as_deref() != Some(me) {
        return None;
    }
    spec.holder_identity = None;
    spec.renew_time = None;
    Some(lease)
}

pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    observed: Observed,
}

impl LeaseLock {
    pub fn new(client: Client, namespace: &str, name: &str, identity: &str, duration: Duration) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.into(),
            identity: identity.into(),
            duration,
            observed: Observed::new(Instant::now()),
        }
    }

    /// Waits until this identity holds the lease.
    pub async fn acquire(&mut self) {
        loop {
            if let Err(e) = self.round().await {
                tracing::warn!(error = %e, "leader election");
            }
            if self.observed.renewed_at.is_some() {
                return;
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Renews the lease while we lead; returns as soon as we no longer may
    /// (another holder, or no renewal within the renew deadline), and the
    /// caller must then stop acting as leader.
    pub async fn hold(&mut self) {
        while let Some(renewed_at) = self.observed.renewed_at {
            let deadline = renewed_at + renew_deadline(self.duration);
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!("the lease was not renewed in time");
                    self.observed.renewed_at = None;
                }
                result = async {
                    tokio::time::sleep(RETRY).await;
                    self.round().await
                } => {
                    if let Err(e) = result {
                        tracing::warn!(error = %e, "renewing the lease");
                    }
                }
            }
        }
    }

    /// Gives the lease up (compare-and-swap) so a standby takes over at once.
    pub async fn release(&mut self) {
        self.observed.renewed_at = None;
        let Ok(Some(lease)) = self.api.get_opt(&self.name).await else { return };
        if let Some(lease) = released(lease, &self.identity)
            && let Err(e) = self.api.replace(&self.name, &PostParams::default(), &lease).await
        {
            tracing::warn!(error = %e, "releasing the lease");
        }
    }

    /// One read, [`decide`], and the write it calls for. Leaves
    /// `observed.renewed_at` set when we lead afterwards.
    async fn round(&mut self) -> Result<(), kube::Error> {
        let current = self.api.get_opt(&self.name).await?;
        let now = Instant::now();
        self.observed.observe(current.as_ref().map(Record::of), now);
        match decide(&self.observed, now, &self.identity, self.duration) {
            Decision::Wait => Ok(()),
            Decision::Lost => {
                self.observed.renewed_at = None;
                Ok(())
            }
            Decision::Acquire | Decision::Renew => {
                let exists = current.is_some();
                let lease = claimed(current, &self.name, &self.identity, Timestamp::now(), self.duration);
                let sent = Instant::now();
                let written = if exists {
                    self.api.replace(&self.name, &PostParams::default(), &lease).await
                } else {
                    self.api.create(&PostParams::default(), &lease).await
                };
                match written {
                    Ok(lease) => {
                        self.observed.observe(Some(Record::of(&lease)), Instant::now());
                        self.observed.renewed_at = Some(sent);
                        Ok(())
                    }
                    // Someone else wrote first: the next read tells who holds it.
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                    Err(e) => Err(e),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(15);
    const ME: &str = "me";

    fn record(holder: &str, resource_version: &str, renew_time: Timestamp) -> Option<Record> {
        Some(Record {
            holder: (!holder.is_empty()).then(|| holder.to_string()),
            renew_time: Some(MicroTime(renew_time)),
            resource_version: Some(resource_version.to_string()),
            lease_duration: Some(D),
        })
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// A standby that first read `rec` at `t0`.
    fn standby(rec: Option<Record>, t0: Instant) -> Observed {
        let mut o = Observed::new(t0);
        o.observe(rec, t0);
        o
    }

    #[test]
    fn a_missing_or_free_lease_is_acquired() {
        let t0 = Instant::now();
        assert_eq!(decide(&Observed::new(t0), t0, ME, D), Decision::Acquire);
        let free = standby(record("", "7", Timestamp::now()), t0);
        assert_eq!(decide(&free, t0, ME, D), Decision::Acquire);
    }

    #[test]
    fn a_lease_another_replica_renews_is_left_alone() {
        let t0 = Instant::now();
        let mut o = standby(record("other", "1", Timestamp::now()), t0);
        assert_eq!(decide(&o, t0, ME, D), Decision::Wait);
        assert_eq!(decide(&o, t0 + secs(14), ME, D), Decision::Wait);
        // Renewed every few seconds: never expires from where we stand.
        for i in 1..20u64 {
            let now = t0 + secs(5 * i);
            o.observe(record("other", &(i + 1).to_string(), Timestamp::now()), now);
            assert_eq!(decide(&o, now + secs(14), ME, D), Decision::Wait, "round {i}");
        }
    }

    #[test]
    fn a_lease_unchanged_for_a_whole_duration_is_taken_over() {
        let t0 = Instant::now();
        let wall = Timestamp::now();
        let mut o = standby(record("other", "1", wall), t0);
        // The same record read again does not restart the clock.
        o.observe(record("other", "1", wall), t0 + secs(10));
        assert_eq!(o.changed_at, t0);
        assert_eq!(decide(&o, t0 + secs(15) - Duration::from_millis(1), ME, D), Decision::Wait);
        assert_eq!(decide(&o, t0 + secs(15), ME, D), Decision::Acquire);
        assert_eq!(decide(&o, t0 + secs(60), ME, D), Decision::Acquire);
    }

    #[test]
    fn the_clock_starts_when_this_replica_first_sees_the_lease() {
        // A lease last renewed an hour ago by the holder's clock is still
        // given a whole duration from our first read.
        let t0 = Instant::now();
        let an_hour_ago = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_hours(1);
        let o = standby(record("other", "1", an_hour_ago), t0 + secs(100));
        assert_eq!(decide(&o, t0 + secs(101), ME, D), Decision::Wait);
        assert_eq!(decide(&o, t0 + secs(115), ME, D), Decision::Acquire);
    }

    #[test]
    fn the_holders_renew_time_is_ignored_whatever_the_skew() {
        let t0 = Instant::now();
        let wall = Timestamp::now();
        let skew = k8s_openapi::jiff::SignedDuration::from_hours(24 * 365);
        // Far in the future: no everlasting lease.
        let o = standby(record("other", "1", wall + skew), t0);
        assert_eq!(decide(&o, t0 + secs(1), ME, D), Decision::Wait);
        assert_eq!(decide(&o, t0 + secs(15), ME, D), Decision::Acquire);
        // Far in the past, but changing: alive.
        let mut o = standby(record("other", "1", wall - skew), t0);
        o.observe(record("other", "2", wall - skew + k8s_openapi::jiff::SignedDuration::from_secs(2)), t0 + secs(10));
        assert_eq!(decide(&o, t0 + secs(20), ME, D), Decision::Wait);
        assert_eq!(decide(&o, t0 + secs(25), ME, D), Decision::Acquire);
        // A change of renewTime alone (same resourceVersion, as a fake API
        // might serve) is a change too.
        let mut o = standby(record("other", "1", wall), t0);
        o.observe(record("other", "1", wall + k8s_openapi::jiff::SignedDuration::from_secs(2)), t0 + secs(10));
        assert_eq!(decide(&o, t0 + secs(20), ME, D), Decision::Wait);
    }

    #[test]
    fn a_longer_duration_declared_by_the_holder_is_honoured() {
        let t0 = Instant::now();
        let mut rec = record("other", "1", Timestamp::now());
        if let Some(r) = rec.as_mut() {
            r.lease_duration = Some(secs(60));
        }
        let o = standby(rec, t0);
        assert_eq!(decide(&o, t0 + secs(30), ME, D), Decision::Wait);
        assert_eq!(decide(&o, t0 + secs(60), ME, D), Decision::Acquire);
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let t0 = Instant::now();
        let mut o = standby(record("other", "1", Timestamp::now()), t0);
        assert_eq!(decide(&o, t0 + secs(2), ME, D), Decision::Wait);
        o.observe(record("", "2", Timestamp::now()), t0 + secs(2));
        assert_eq!(decide(&o, t0 + secs(2), ME, D), Decision::Acquire);
    }

    #[test]
    fn our_own_lease_is_renewed_within_the_renew_deadline() {
        let t0 = Instant::now();
        let mut o = standby(record(ME, "1", Timestamp::now()), t0);
        o.renewed_at = Some(t0);
        assert_eq!(decide(&o, t0 + secs(2), ME, D), Decision::Renew);
        assert_eq!(decide(&o, t0 + secs(9), ME, D), Decision::Renew);
        // Not renewed for the renew deadline: step down before any standby
        // (who waits a whole duration) may take over.
        assert_eq!(renew_deadline(D), secs(10));
        assert_eq!(decide(&o, t0 + secs(10), ME, D), Decision::Lost);
    }

    #[test]
    fn a_lease_taken_by_another_replica_is_lost() {
        let t0 = Instant::now();
        let mut o = standby(record(ME, "1", Timestamp::now()), t0);
        o.renewed_at = Some(t0);
        o.observe(record("other", "2", Timestamp::now()), t0 + secs(1));
        assert_eq!(decide(&o, t0 + secs(1), ME, D), Decision::Lost);
        // Released or deleted under us: not ours either.
        o.observe(record("", "3", Timestamp::now()), t0 + secs(2));
        assert_eq!(decide(&o, t0 + secs(2), ME, D), Decision::Lost);
        o.observe(None, t0 + secs(3));
        assert_eq!(decide(&o, t0 + secs(3), ME, D), Decision::Lost);
    }

    #[test]
    fn a_lease_left_in_our_name_by_an_earlier_run_is_reacquired() {
        let t0 = Instant::now();
        let o = standby(record(ME, "1", Timestamp::now()), t0);
        assert_eq!(decide(&o, t0, ME, D), Decision::Acquire);
    }

    #[test]
    fn the_leader_steps_down_before_a_standby_may_take_over() {
        // The leader's write is sent at `sent`; a standby can only see it
        // after that. Whatever the read delays, the leader's Lost comes first.
        let sent = Instant::now();
        let mut leader = standby(record(ME, "5", Timestamp::now()), sent);
        leader.renewed_at = Some(sent);
        for seen_after in [0u64, 1, 3] {
            let standby = standby(record(ME, "5", Timestamp::now()), sent + secs(seen_after));
            let takeover = (0..60u64)
                .map(|s| sent + secs(s))
                .find(|t| decide(&standby, *t, "other", D) == Decision::Acquire)
                .unwrap();
            let stepped_down =
                (0..60u64).map(|s| sent + secs(s)).find(|t| decide(&leader, *t, ME, D) == Decision::Lost).unwrap();
            assert!(stepped_down < takeover, "seen after {seen_after}s");
        }
    }

    fn lease(holder: Option<&str>, resource_version: &str, transitions: i32) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("streamfleet-leader".into()),
                resource_version: Some(resource_version.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                lease_duration_seconds: Some(15),
                acquire_time: Some(MicroTime(Timestamp::UNIX_EPOCH)),
                renew_time: Some(MicroTime(Timestamp::UNIX_EPOCH)),
                lease_transitions: Some(transitions),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn claims_create_take_over_and_renew_as_compare_and_swap() {
        let now = Timestamp::now();
        let created = claimed(None, "streamfleet-leader", ME, now, D);
        assert_eq!(created.metadata.name.as_deref(), Some("streamfleet-leader"));
        assert_eq!(created.metadata.resource_version, None);
        let spec = created.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some(ME));
        assert_eq!((spec.lease_duration_seconds, spec.lease_transitions), (Some(15), Some(0)));
        assert_eq!(spec.renew_time, Some(MicroTime(now)));

        let taken = claimed(Some(lease(Some("other"), "41", 3)), "streamfleet-leader", ME, now, D);
        assert_eq!(taken.metadata.resource_version.as_deref(), Some("41"), "replace is conditional on it");
        let spec = taken.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some(ME));
        assert_eq!(spec.lease_transitions, Some(4));
        assert_eq!((spec.acquire_time.clone(), spec.renew_time), (Some(MicroTime(now)), Some(MicroTime(now))));

        let renewed = claimed(Some(lease(Some(ME), "42", 4)), "streamfleet-leader", ME, now, D);
        assert_eq!(renewed.metadata.resource_version.as_deref(), Some("42"));
        let spec = renewed.spec.unwrap();
        assert_eq!(spec.lease_transitions, Some(4));
        assert_eq!(spec.acquire_time, Some(MicroTime(Timestamp::UNIX_EPOCH)), "still the same term");
        assert_eq!(spec.renew_time, Some(MicroTime(now)));

        let after_release = claimed(Some(lease(None, "43", 4)), "streamfleet-leader", ME, now, D);
        assert_eq!(after_release.spec.unwrap().lease_transitions, Some(5));
    }

    #[test]
    fn only_our_own_lease_is_released() {
        assert!(released(lease(Some("other"), "1", 0), ME).is_none());
        assert!(released(lease(None, "1", 0), ME).is_none());
        let given_up = released(lease(Some(ME), "9", 0), ME).unwrap();
        assert_eq!(given_up.metadata.resource_version.as_deref(), Some("9"));
        let spec = given_up.spec.unwrap();
        assert_eq!((spec.holder_identity, spec.renew_time), (None, None));
        assert_eq!(Record::of(&lease(Some(""), "1", 0)).holder, None, "an empty holder is no holder");
    }
}
