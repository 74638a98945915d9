//! The operator binary's Redis-side subcommands: the recovery sweep the
//! CronJob runs, and dead-letter inspection and replay for people.

use anyhow::{Context as _, Result, bail};
use streamfleet_streams::WorkerConfig;
use streamfleet_streams::deadletter as dl;
use streamfleet_streams::recovery::write_report;
use streamfleet_streams::replay::{Replayed, Selection, replay};
use streamfleet_streams::sweep::{SweepSettings, sweep};
use streamfleet_streams::{Endpoint, Mode, StreamConnection};

/// `streamfleet sweep`: one pass over the PEL of every stream in the env
/// contract; writes the report the operator shows as `status.lastRecovery`,
/// and prints it as JSON.
pub async fn run_sweep() -> Result<()> {
    let config = WorkerConfig::from_env().context("the recovery Job's environment")?;
    let mut conn = StreamConnection::connect(&config.endpoint).await?;
    // One run over every shard: each shard's figures are printed, and the
    // run's total is the report every shard carries (the operator shows one).
    let mut total = streamfleet_streams::recovery::RecoveryReport::default();
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
        let report = sweep(&mut conn, &settings).await?;
        println!(
            "{}",
            serde_json::json!({
                "stream": stream, "group": config.group, "scanned": report.scanned, "claimed": report.claimed,
                "deadLettered": report.dead_lettered, "payloadLost": report.payload_lost,
            })
        );
        total.scanned += report.scanned;
        total.claimed += report.claimed;
        total.dead_lettered += report.dead_lettered;
        total.payload_lost += report.payload_lost;
        total.finished_at_ms = total.finished_at_ms.max(report.finished_at_ms);
    }
    for stream in &config.streams {
        write_report(&mut conn, stream, &config.group, &total).await?;
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct DeadLetterArgs {
    /// Redis URL (credentials included); defaults to the env contract's.
    #[arg(long, env = "STREAMFLEET_REDIS_URL", hide_env_values = true)]
    redis_url: String,
    /// Treat the URL as a Redis Cluster node.
    #[arg(long)]
    cluster: bool,
    /// The dead-letter stream, e.g. `{orders}:dead`.
    #[arg(long, env = "STREAMFLEET_DEAD_LETTER_STREAM")]
    dead_letter_stream: String,
    #[command(subcommand)]
    command: DeadLetterCommand,
}

#[derive(clap::Subcommand)]
enum DeadLetterCommand {
    /// One line per dead letter: ID, reason, source, business key, error.
    List,
    /// Re-add dead letters to their source stream and remove them here.
    Replay {
        /// Dead-letter IDs to replay (comma-separated).
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["from", "all"])]
        ids: Vec<String>,
        /// First dead-letter ID of a range (inclusive; `-` for the start).
        #[arg(long, requires = "to", conflicts_with = "all")]
        from: Option<String>,
        /// Last dead-letter ID of a range (inclusive; `+` for the end).
        #[arg(long, requires = "from")]
        to: Option<String>,
        /// Replay every dead letter.
        #[arg(long)]
        all: bool,
        /// Say what would happen, change nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

pub async fn run_dead_letters(args: DeadLetterArgs) -> Result<()> {
    let mode = if args.cluster { Mode::Cluster } else { Mode::Standalone };
    let mut conn = StreamConnection::connect(&Endpoint { url: args.redis_url, mode, ca_pem: None }).await?;
    match args.command {
        DeadLetterCommand::List => {
            let range: redis::streams::StreamRangeReply =
                redis::cmd("XRANGE").arg(&args.dead_letter_stream).arg("-").arg("+").query_async(&mut conn).await?;
            let count = range.ids.len();
            for e in range.ids {
                let f = streamfleet_streams::entry::fields_from_map(e.map);
                let get = |k: &str| {
                    f.iter()
                        .find(|(n, _)| n == k)
                        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                        .unwrap_or_default()
                };
                println!(
                    "{}\t{}\t{} {}\tkey={}\t{}",
                    e.id,
                    get(dl::F_REASON),
                    get(dl::F_SOURCE_STREAM),
                    get(dl::F_SOURCE_ID),
                    get(dl::F_BUSINESS_KEY),
                    get(dl::F_ERROR)
                );
            }
            eprintln!("{count} dead letters");
        }
        DeadLetterCommand::Replay { ids, from, to, all, dry_run } => {
            let selection = match (ids.is_empty(), from, to, all) {
                (false, _, _, _) => Selection::Ids(ids),
                (true, Some(from), Some(to), _) => Selection::Range { from, to },
                (true, _, _, true) => Selection::All,
                _ => bail!("say which: --ids, --from/--to, or --all"),
            };
            let mut requeued = 0;
            for r in replay(&mut conn, &args.dead_letter_stream, &selection, dry_run).await? {
                match r {
                    Replayed::Requeued { dead_letter_id, source_stream, new_id, business_key } => {
                        requeued += 1;
                        println!(
                            "requeued {dead_letter_id} -> {source_stream} {new_id} key={}",
                            business_key.unwrap_or_default()
                        );
                    }
                    Replayed::Skipped { dead_letter_id, why } => println!("skipped {dead_letter_id}: {why}"),
                }
            }
            eprintln!("{requeued} requeued{}", if dry_run { " (dry run)" } else { "" });
        }
    }
    Ok(())
}
