//! The recovery CronJob's runs as the CronJob's own status tells them, for
//! the `RecoveryFailing` condition: a run that cannot pull its image, crashes
//! past its Job's back-off limit or hangs to its deadline writes no recovery
//! report, so `status.lastRecovery` alone would only age.
//!
//! The CronJob controller removes a finished Job from `status.active` and,
//! in the same update, moves `lastSuccessfulTime` to its finish time when it
//! succeeded. So with no run active, the last run (scheduled at
//! `lastScheduleTime`) failed exactly when no success came after it. While
//! a run is active its outcome is not known yet, and the CronJob no longer
//! tells how the run before it ended: the condition stays as it was.

use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// How the recovery CronJob's last run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LastRun {
    /// No run scheduled yet (or no CronJob): nothing to say.
    NotYet,
    /// A run is active: the last finished run's outcome stands as shown.
    Running,
    /// The last run finished successfully at `at`.
    Succeeded { at: Time },
    /// The run scheduled at `scheduled` ended without success (its Job
    /// failed: back-off limit, deadline, or deleted unfinished).
    Failed { scheduled: Time, last_success: Option<Time> },
}

/// How the last run of `cronjob` ended, from its status.
pub fn last_run(cronjob: Option<&CronJob>) -> LastRun {
    let Some(status) = cronjob.and_then(|c| c.status.as_ref()) else { return LastRun::NotYet };
    if status.active.as_ref().is_some_and(|a| !a.is_empty()) {
        return LastRun::Running;
    }
    let success = &status.last_successful_time;
    let Some(scheduled) = &status.last_schedule_time else {
        return success.clone().map_or(LastRun::NotYet, |at| LastRun::Succeeded { at });
    };
    match success {
        Some(at) if at.0 >= scheduled.0 => LastRun::Succeeded { at: at.clone() },
        _ => LastRun::Failed { scheduled: scheduled.clone(), last_success: success.clone() },
    }
}

/// What the condition and the Warning say of a failed run.
pub fn failed_message(scheduled: &Time, last_success: Option<&Time>, job_prefix: &str) -> String {
    let since = match last_success {
        Some(t) => format!("the last run that succeeded finished at {}", t.0),
        None => "no run has succeeded yet".to_string(),
    };
    format!(
        "the recovery run scheduled at {} ended without success (its Job failed: a crash past its back-off limit, an \
         image that cannot be pulled, or its deadline); {since}. Stuck entries are not claimed or dead-lettered \
         meanwhile: see `kubectl get jobs` and the logs of the {job_prefix}-* pods",
        scheduled.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::batch::v1::CronJobStatus;
    use k8s_openapi::api::core::v1::ObjectReference;

    fn at(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap())
    }

    fn cronjob(active: usize, scheduled: Option<i64>, succeeded: Option<i64>) -> CronJob {
        CronJob {
            status: Some(CronJobStatus {
                active: Some(vec![ObjectReference::default(); active]),
                last_schedule_time: scheduled.map(at),
                last_successful_time: succeeded.map(at),
            }),
            ..CronJob::default()
        }
    }

    #[test]
    fn a_run_is_failed_only_when_finished_with_no_success_after_its_schedule() {
        assert_eq!(last_run(None), LastRun::NotYet);
        assert_eq!(last_run(Some(&CronJob::default())), LastRun::NotYet);
        assert_eq!(last_run(Some(&cronjob(0, None, None))), LastRun::NotYet);
        // Scheduled and still running: not known yet, whatever came before.
        assert_eq!(last_run(Some(&cronjob(1, Some(100), None))), LastRun::Running);
        assert_eq!(last_run(Some(&cronjob(1, Some(100), Some(50)))), LastRun::Running);
        // Finished, the success after the schedule (a Job finishes after it starts).
        assert_eq!(last_run(Some(&cronjob(0, Some(100), Some(104)))), LastRun::Succeeded { at: at(104) });
        // Finished with no success after it: failed, naming the last success.
        assert_eq!(
            last_run(Some(&cronjob(0, Some(100), Some(50)))),
            LastRun::Failed { scheduled: at(100), last_success: Some(at(50)) }
        );
        assert_eq!(
            last_run(Some(&cronjob(0, Some(100), None))),
            LastRun::Failed { scheduled: at(100), last_success: None }
        );
    }

    #[test]
    fn the_message_names_the_run_and_the_last_success() {
        let m = failed_message(&at(100), None, "orders-recovery");
        assert!(m.contains("1970-01-01T00:01:40Z") && m.contains("no run has succeeded yet"), "{m}");
        assert!(m.contains("orders-recovery-*"), "{m}");
        let m = failed_message(&at(100), Some(&at(50)), "orders-recovery");
        assert!(m.contains("finished at 1970-01-01T00:00:50Z"), "{m}");
    }
}
