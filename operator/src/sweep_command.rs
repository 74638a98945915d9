//! The recovery sweep the CronJob runs (`streamfleet sweep`).

use anyhow::{Context as _, Result};
use streamfleet_streams::StreamConnection;
use streamfleet_streams::WorkerConfig;
use streamfleet_streams::recovery::write_report;
use streamfleet_streams::sweep::{SweepSettings, sweep};

/// `streamfleet sweep`: one pass over the PEL of every stream in the env
/// contract; writes the report the operator shows as `status.lastRecovery`,
/// and prints it as JSON. Fails when anything was left unsettled, after
/// sweeping everything else.
pub async fn run_sweep() -> Result<()> {
    let config = WorkerConfig::from_env().context("the recovery Job's environment")?;
    let mut conn = StreamConnection::connect(&config.endpoint).await?;
    // One run over every shard: each shard's figures are printed, and the
    // run's total is the report every shard carries (the operator shows one).
    let mut total = streamfleet_streams::recovery::RecoveryReport::default();
    let (mut left_pending, mut reported) = (Vec::new(), false);
    for stream in &config.streams {
        let dead_letter_stream = config.dead_letter_stream_of(stream);
        let settings = SweepSettings {
            stream,
            group: &config.group,
            consumer: &config.consumer,
            dead_letter_stream: &dead_letter_stream,
            min_idle: config.min_idle,
            max_deliveries: config.max_deliveries,
            batch: config.batch_size,
        };
        // One shard that fails does not keep the others from being swept.
        let report = match sweep(&mut conn, &settings).await {
            Ok(report) => report,
            Err(e) => {
                left_pending.push(format!("{stream}: {e}"));
                continue;
            }
        };
        left_pending.extend(report.left_pending.iter().map(|why| format!("{stream}: {why}")));
        reported = true;
        println!(
            "{}",
            serde_json::json!({
                "stream": stream, "group": config.group, "scanned": report.scanned, "claimed": report.claimed,
                "deadLettered": report.dead_lettered, "payloadLost": report.payload_lost, "leftPending": report.left_pending,
            })
        );
        total.scanned += report.scanned;
        total.claimed += report.claimed;
        total.dead_lettered += report.dead_lettered;
        total.payload_lost += report.payload_lost;
        total.finished_at_ms = total.finished_at_ms.max(report.finished_at_ms);
    }
    // A run that swept no shard at all leaves the last report as it was.
    if reported && let Err(e) = write_report_everywhere(&mut conn, &config, &total).await {
        left_pending.push(format!("the recovery report: {e}"));
    }
    // The run fails (its Job shows `RecoveryFailing`), naming what it left.
    for why in &left_pending {
        eprintln!("left pending: {why}");
    }
    if let Some(first) = left_pending.first() {
        anyhow::bail!(
            "{} entries or pages could not be settled and were left pending for the next run; the first: {first}",
            left_pending.len()
        );
    }
    Ok(())
}

async fn write_report_everywhere(
    conn: &mut StreamConnection,
    config: &WorkerConfig,
    total: &streamfleet_streams::recovery::RecoveryReport,
) -> Result<(), streamfleet_streams::StreamError> {
    for stream in &config.streams {
        write_report(conn, streamfleet_streams::GroupRef::new(stream, &config.group), total).await?;
    }
    Ok(())
}
