//! How the recovery runs end, from their Jobs (the operator's watch cache),
//! for the `RecoveryFailing` condition: a run that cannot pull its image,
//! crashes past its back-off limit or hangs to its deadline writes no
//! recovery report, so `status.lastRecovery` alone would only age.
//!
//! The newest finished Job decides, by creation time: a Job still running
//! says nothing yet, so the last finished run's outcome stands meanwhile.
//! The CronJob's own status cannot tell: under `Forbid` a run that ends past
//! the next schedule time is followed at once by the next, so `active` is
//! never seen empty, and `lastSuccessfulTime` (a finish time) can be later
//! than the schedule time of a run that failed after it.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::sync::Arc;

/// How the newest finished recovery run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LastRun {
    /// No run has finished (none ran, or the first is running).
    NotYet,
    /// Its Job completed.
    Succeeded,
    /// Its Job failed, for `reason` (`BackoffLimitExceeded`,
    /// `DeadlineExceeded`, ...) as its `Failed` condition says.
    Failed { job: String, created: Option<Time>, reason: String, detail: String, last_success: Option<Time> },
}

/// Whether `job` finished, and how: `(true, "", "")` completed, `(false,
/// reason, message)` failed as its `Failed` condition says; `None` running.
fn finished(job: &Job) -> Option<(bool, &str, &str)> {
    let conditions = job.status.as_ref()?.conditions.as_ref()?;
    conditions.iter().filter(|c| c.status == "True").find_map(|c| match c.type_.as_str() {
        "Complete" => Some((true, "", "")),
        "Failed" => Some((false, c.reason.as_deref().unwrap_or(""), c.message.as_deref().unwrap_or(""))),
        _ => None,
    })
}

/// How the newest finished of `jobs` (one resource's recovery Jobs) ended.
pub fn last_run(jobs: &[Arc<Job>]) -> LastRun {
    let created = |j: &Job| j.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let newest = jobs
        .iter()
        .filter_map(|j| finished(j).map(|f| (j, f)))
        .max_by_key(|(j, _)| (created(j), j.metadata.name.clone()));
    let Some((job, (complete, reason, detail))) = newest else { return LastRun::NotYet };
    if complete {
        return LastRun::Succeeded;
    }
    let name = job.metadata.name.clone().unwrap_or_default();
    let completed_at = |j: &Job| j.status.as_ref().and_then(|s| s.completion_time.clone());
    let last_success = jobs
        .iter()
        .filter(|j| finished(j).is_some_and(|(complete, _, _)| complete))
        .filter_map(|j| completed_at(j))
        .max_by_key(|t| t.0);
    LastRun::Failed {
        job: name,
        created: job.metadata.creation_timestamp.clone(),
        reason: reason.to_string(),
        detail: detail.to_string(),
        last_success,
    }
}

/// What the condition and the Warning say of a failed run.
pub fn failed_message(run: &LastRun) -> Option<String> {
    let LastRun::Failed { job, created, reason, detail, last_success } = run else { return None };
    let since = match last_success {
        Some(t) => format!("the last run that succeeded finished at {}", t.0),
        None => "no run on record succeeded".to_string(),
    };
    let started = created.as_ref().map(|t| format!(", started {}", t.0)).unwrap_or_default();
    let why = match (reason.is_empty(), detail.is_empty()) {
        (true, _) => String::new(),
        (false, true) => format!(": {reason}"),
        (false, false) => format!(": {reason} ({detail})"),
    };
    Some(format!(
        "recovery Job {job}{started} failed{why}; {since}. Stuck entries are not claimed or dead-lettered meanwhile: \
         see its pods' logs (kubectl logs job/{job})"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};

    fn at(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap())
    }

    /// A Job created at `created`: running (`None`), or finished complete
    /// (`Some(true)`) or failed at `created + 10`.
    fn job(name: &str, created: i64, outcome: Option<bool>) -> Arc<Job> {
        let condition = |type_: &str, reason: &str| JobCondition {
            type_: type_.into(),
            status: "True".into(),
            reason: Some(reason.into()),
            message: Some("Job was active longer than specified deadline".into()).filter(|_| type_ == "Failed"),
            last_probe_time: None,
            last_transition_time: None,
        };
        Arc::new(Job {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                creation_timestamp: Some(at(created)),
                ..Default::default()
            },
            status: Some(JobStatus {
                conditions: outcome.map(|ok| match ok {
                    true => vec![condition("Complete", "")],
                    false => vec![condition("Failed", "DeadlineExceeded")],
                }),
                completion_time: outcome.filter(|ok| *ok).map(|_| at(created + 10)),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    #[test]
    fn the_newest_finished_job_decides() {
        assert_eq!(last_run(&[]), LastRun::NotYet);
        assert_eq!(last_run(&[job("r-1", 100, None)]), LastRun::NotYet, "the first run is still going");
        let failed = LastRun::Failed {
            job: "r-2".into(),
            created: Some(at(200)),
            reason: "DeadlineExceeded".into(),
            detail: "Job was active longer than specified deadline".into(),
            last_success: Some(at(110)),
        };
        let jobs = [job("r-1", 100, Some(true)), job("r-2", 200, Some(false))];
        assert_eq!(last_run(&jobs), failed);
        // The next run running changes nothing: the failure stands.
        let jobs = [job("r-1", 100, Some(true)), job("r-2", 200, Some(false)), job("r-3", 300, None)];
        assert_eq!(last_run(&jobs), failed);
        // It succeeds, whatever the order the cache lists them in.
        let jobs = [job("r-3", 300, Some(true)), job("r-2", 200, Some(false))];
        assert_eq!(last_run(&jobs), LastRun::Succeeded);
        // A success that finished after a later run was created does not hide that run's failure.
        let late = job("r-4", 400, Some(true));
        let jobs = [late, job("r-5", 405, Some(false))];
        assert!(matches!(last_run(&jobs), LastRun::Failed { ref job, .. } if job == "r-5"));
    }

    #[test]
    fn the_message_names_the_job_its_reason_and_the_last_success() {
        let m = failed_message(&last_run(&[job("r-2", 200, Some(false))])).unwrap();
        assert!(m.contains("recovery Job r-2, started 1970-01-01T00:03:20Z failed: DeadlineExceeded"), "{m}");
        assert!(m.contains("no run on record succeeded") && m.contains("kubectl logs job/r-2"), "{m}");
        let m = failed_message(&last_run(&[job("r-1", 100, Some(true)), job("r-2", 200, Some(false))])).unwrap();
        assert!(m.contains("finished at 1970-01-01T00:01:50Z"), "{m}");
        assert_eq!(failed_message(&LastRun::NotYet), None);
    }
}
