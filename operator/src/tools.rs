//! The operator binary's Redis-side subcommands: the recovery sweep the
//! CronJob runs, and dead-letter inspection and replay for people.

use anyhow::{Context as _, Result, bail};
use streamfleet_streams::WorkerConfig;
use streamfleet_streams::dlq::{self, DeadLetter, Filter};
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
    /// The pipeline, `namespace/name`: its Redis URL, CA and dead-letter
    /// streams come from the resource and its Secrets, read with your
    /// kubeconfig (you need `get` on both).
    #[arg(long, conflicts_with_all = ["redis_url", "dead_letter_stream"])]
    pipeline: Option<String>,
    /// Redis URL (credentials included), when not resolving a pipeline.
    #[arg(long, env = "STREAMFLEET_REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// Treat the URL as a Redis Cluster node.
    #[arg(long)]
    cluster: bool,
    /// PEM CA bundle that signs a `rediss://` server's certificate.
    #[arg(long)]
    ca_file: Option<std::path::PathBuf>,
    /// The dead-letter stream, e.g. `{orders}:dead`.
    #[arg(long, env = "STREAMFLEET_DEAD_LETTER_STREAM")]
    dead_letter_stream: Option<String>,
    /// `text` (default) or `json` (one object per line).
    #[arg(long, short = 'o', default_value = "text")]
    output: Output,
    #[command(subcommand)]
    command: DeadLetterCommand,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Output {
    Text,
    Json,
}

/// Which letters (every condition must hold).
#[derive(clap::Args, Clone, Default)]
struct FilterArgs {
    /// Only these reasons (comma-separated): permanent, malformed, max-deliveries, payload-missing, crashed-worker.
    #[arg(long, value_delimiter = ',')]
    reason: Vec<String>,
    /// Dead-lettered at or after: RFC 3339 (`2026-12-01T10:00:00Z`) or Unix ms.
    #[arg(long)]
    since: Option<String>,
    /// Dead-lettered before: RFC 3339 or Unix ms.
    #[arg(long)]
    until: Option<String>,
    /// Only this business key.
    #[arg(long)]
    key: Option<String>,
    /// First dead-letter ID (inclusive).
    #[arg(long)]
    from: Option<String>,
    /// Last dead-letter ID (inclusive).
    #[arg(long)]
    to: Option<String>,
}

impl FilterArgs {
    fn filter(&self) -> Result<Filter> {
        Ok(Filter {
            reasons: self.reason.clone(),
            since_ms: self.since.as_deref().map(|t| time_ms("--since", t)).transpose()?,
            until_ms: self.until.as_deref().map(|t| time_ms("--until", t)).transpose()?,
            business_key: self.key.clone(),
            from: self.from.clone(),
            to: self.to.clone(),
        })
    }
}

/// Which letters `replay` and `purge` act on: IDs, a filter, or all of them.
#[derive(clap::Args, Clone)]
struct ChosenArgs {
    /// Dead-letter IDs (comma-separated).
    #[arg(long, value_delimiter = ',', conflicts_with = "all")]
    ids: Vec<String>,
    #[command(flatten)]
    filter: FilterArgs,
    /// Every dead letter.
    #[arg(long)]
    all: bool,
    /// Say what would happen, change nothing.
    #[arg(long)]
    dry_run: bool,
}

impl ChosenArgs {
    /// Never everything by default: the user says which.
    fn selection(&self) -> Result<Selection> {
        let filter = self.filter.filter()?;
        Ok(if !self.ids.is_empty() {
            Selection::Ids(self.ids.clone())
        } else if filter != Filter::default() {
            Selection::Matching(filter)
        } else if self.all {
            Selection::All
        } else {
            bail!("say which: --ids, a filter (--reason, --since, --until, --key, --from, --to), or --all");
        })
    }
}

#[derive(clap::Subcommand)]
enum DeadLetterCommand {
    /// A page of dead letters (ID, time, reason, source, business key, error);
    /// the last line says how to read the next page.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Letters per page.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Read the page after this dead-letter ID (the previous page's cursor).
        #[arg(long)]
        after: Option<String>,
    },
    /// One dead letter in full: metadata and original fields.
    Show {
        /// The dead letter's ID.
        id: String,
    },
    /// Counts by reason and by hour.
    Stats {
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// Re-add dead letters to their source stream (for their own group) and
    /// remove them here; a business key completed since is not replayed.
    Replay {
        #[command(flatten)]
        chosen: ChosenArgs,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        chosen: ChosenArgs,
        /// Required to delete: purged letters cannot be replayed.
        #[arg(long)]
        yes: bool,
    },
}

/// Run as the kubectl plugin (`kubectl-streamfleet`, found on the PATH):
/// `kubectl streamfleet dlq …` is `streamfleet dead-letters …`.
pub fn plugin_args(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let plugin = args
        .first()
        .and_then(|program| std::path::Path::new(program).file_name())
        .is_some_and(|name| name == "kubectl-streamfleet");
    if plugin && args.get(1).is_some_and(|a| a == "dlq") {
        args[1] = "dead-letters".into();
    }
    args
}

/// RFC 3339 or Unix milliseconds.
fn time_ms(flag: &str, text: &str) -> Result<u64> {
    if let Ok(ms) = text.parse::<u64>() {
        return Ok(ms);
    }
    let at: k8s_openapi::jiff::Timestamp =
        text.parse().with_context(|| format!("{flag} {text:?}: not RFC 3339 (2026-12-01T10:00:00Z) nor Unix ms"))?;
    u64::try_from(at.as_millisecond()).with_context(|| format!("{flag} {text:?}: before 1970"))
}

fn rfc3339(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(|ms| k8s_openapi::jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(|| ms.to_string(), |t| t.to_string())
}

/// Where the letters are: a connection and the dead-letter streams (one per shard).
async fn target(args: &DeadLetterArgs) -> Result<(StreamConnection, Vec<String>)> {
    let ca_file = match &args.ca_file {
        Some(path) => Some(std::fs::read(path).with_context(|| format!("--ca-file {}", path.display()))?),
        None => None,
    };
    let (endpoint, streams) = match &args.pipeline {
        Some(pipeline) => {
            let (endpoint, streams) = resolve_pipeline(pipeline).await?;
            (Endpoint { ca_pem: ca_file.or(endpoint.ca_pem), ..endpoint }, streams)
        }
        None => {
            let url = args.redis_url.clone().context("say where: --pipeline NAMESPACE/NAME, or --redis-url")?;
            let stream = args.dead_letter_stream.clone().context("--dead-letter-stream (or --pipeline)")?;
            let mode = if args.cluster { Mode::Cluster } else { Mode::Standalone };
            (Endpoint { url, mode, ca_pem: ca_file }, vec![stream])
        }
    };
    Ok((StreamConnection::connect(&endpoint).await?, streams))
}

/// The pipeline's Redis endpoint and dead-letter streams, read with the
/// caller's kubeconfig.
async fn resolve_pipeline(pipeline: &str) -> Result<(Endpoint, Vec<String>)> {
    use k8s_openapi::api::core::v1::Secret;
    use streamfleet_crd::{RedisMode, SecretKeyRef, StreamConsumerGroup};
    let (namespace, name) = pipeline.split_once('/').context("--pipeline: NAMESPACE/NAME")?;
    let client = kube::Client::try_default().await.context("reading your kubeconfig")?;
    let scg = kube::Api::<StreamConsumerGroup>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("StreamConsumerGroup {pipeline}"))?;
    let secrets = kube::Api::<Secret>::namespaced(client, namespace);
    let read = async |r: &SecretKeyRef| -> Result<Vec<u8>> {
        let secret = secrets.get(&r.name).await.with_context(|| format!("Secret {namespace}/{}", r.name))?;
        let value = secret.data.and_then(|mut d| d.remove(&r.key));
        Ok(value.with_context(|| format!("Secret {namespace}/{} has no key {:?}", r.name, r.key))?.0)
    };
    let url = String::from_utf8(read(&scg.spec.redis.url_secret_ref).await?).context("the Redis URL is not UTF-8")?;
    let ca_pem = match scg.spec.redis.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
        Some(r) => Some(read(r).await?),
        None => None,
    };
    let mode = match scg.spec.redis.mode {
        RedisMode::Standalone => Mode::Standalone,
        RedisMode::Cluster => Mode::Cluster,
    };
    let spec = crate::controller::validate::validate(&scg).map_err(|e| anyhow::anyhow!("{pipeline}: {e}"))?;
    let streams = spec.streams.iter().map(|s| spec.dead_letter_stream_of(s)).collect();
    Ok((Endpoint { url: url.trim().to_string(), mode, ca_pem }, streams))
}

fn letter_json(stream: &str, l: &DeadLetter, with_payload: bool) -> serde_json::Value {
    let mut v = serde_json::json!({
        "deadLetterStream": stream, "id": l.id, "at": rfc3339(l.at_ms), "reason": l.reason,
        "sourceStream": l.source_stream, "sourceId": l.source_id, "group": l.group, "consumer": l.consumer,
        "deliveries": l.deliveries, "businessKey": l.business_key, "error": l.error,
    });
    if with_payload {
        let fields: serde_json::Map<String, serde_json::Value> = l
            .payload
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(String::from_utf8_lossy(v).into_owned())))
            .collect();
        v["payload"] = serde_json::Value::Object(fields);
    }
    v
}

fn letter_line(l: &DeadLetter) -> String {
    let or_dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    format!(
        "{}\t{}\t{}\t{} {}\tkey={}\t{}",
        l.id,
        rfc3339(l.at_ms),
        or_dash(&l.reason),
        or_dash(&l.source_stream),
        or_dash(&l.source_id),
        or_dash(&l.business_key),
        or_dash(&l.error)
    )
}

pub async fn run_dead_letters(args: DeadLetterArgs) -> Result<()> {
    let (mut conn, streams) = target(&args).await?;
    let json = matches!(args.output, Output::Json);
    match &args.command {
        DeadLetterCommand::List { filter, limit, after } => {
            let filter = filter.filter()?;
            // The cursor names a letter of one stream; with shards, say which.
            let (mut resume_stream, mut after) = match after.as_deref().map(|a| a.split_once('@')) {
                Some(Some((stream, id))) => (Some(stream.to_string()), Some(id.to_string())),
                Some(None) => (None, after.clone()),
                None => (None, None),
            };
            let mut left = (*limit).max(1);
            let mut next = None;
            for stream in &streams {
                if resume_stream.as_ref().is_some_and(|s| s != stream) {
                    continue;
                }
                resume_stream = None;
                let page = dlq::page(&mut conn, stream, &filter, after.take().as_deref(), left).await?;
                left -= page.letters.len();
                for l in &page.letters {
                    println!("{}", if json { letter_json(stream, l, false).to_string() } else { letter_line(l) });
                }
                if let Some(cursor) = page.next {
                    next = Some(if streams.len() > 1 { format!("{stream}@{cursor}") } else { cursor });
                    break;
                }
            }
            if let Some(cursor) = next {
                eprintln!("more: --after {cursor}");
            }
        }
        DeadLetterCommand::Show { id } => {
            let mut found = None;
            for stream in &streams {
                if let Some(letter) = dlq::show(&mut conn, stream, id).await? {
                    found = Some((stream, letter));
                    break;
                }
            }
            let (stream, l) = found.with_context(|| format!("no dead letter {id} in {}", streams.join(", ")))?;
            if json {
                println!("{}", letter_json(stream, &l, true));
            } else {
                println!("{}", letter_line(&l));
                println!(
                    "group={} consumer={} deliveries={}",
                    l.group.clone().unwrap_or_default(),
                    l.consumer.clone().unwrap_or_default(),
                    l.deliveries.unwrap_or(0)
                );
                for (k, v) in &l.payload {
                    println!("  {k} = {}", String::from_utf8_lossy(v));
                }
            }
        }
        DeadLetterCommand::Stats { filter } => {
            let filter = filter.filter()?;
            let mut stats = dlq::Stats::default();
            for stream in &streams {
                for l in dlq::all(&mut conn, stream, &filter).await? {
                    stats.add(&l);
                }
            }
            let hours: Vec<(String, u64)> = stats.by_hour.iter().map(|(h, n)| (rfc3339(*h), *n)).collect();
            if json {
                let by_hour: serde_json::Map<String, serde_json::Value> =
                    hours.into_iter().map(|(h, n)| (h, n.into())).collect();
                println!(
                    "{}",
                    serde_json::json!({"total": stats.total, "byReason": stats.by_reason, "byHour": by_hour})
                );
            } else {
                println!("total\t{}", stats.total);
                for (reason, n) in &stats.by_reason {
                    println!("reason\t{reason}\t{n}");
                }
                for (hour, n) in hours {
                    println!("hour\t{hour}\t{n}");
                }
            }
        }
        DeadLetterCommand::Replay { chosen } => {
            let (selection, dry_run) = (chosen.selection()?, &chosen.dry_run);
            let mut requeued = 0;
            for stream in &streams {
                for r in replay(&mut conn, stream, &selection, *dry_run).await? {
                    let line = match r {
                        Replayed::Requeued { dead_letter_id, source_stream, new_id, business_key } => {
                            requeued += 1;
                            if json {
                                serde_json::json!({"deadLetterId": dead_letter_id, "requeued": true, "sourceStream": source_stream, "newId": new_id, "businessKey": business_key}).to_string()
                            } else {
                                format!(
                                    "requeued {dead_letter_id} -> {source_stream} {new_id} key={}",
                                    business_key.unwrap_or_default()
                                )
                            }
                        }
                        Replayed::Skipped { dead_letter_id, why } => {
                            if json {
                                serde_json::json!({"deadLetterId": dead_letter_id, "requeued": false, "why": why})
                                    .to_string()
                            } else {
                                format!("skipped {dead_letter_id}: {why}")
                            }
                        }
                    };
                    println!("{line}");
                }
            }
            eprintln!("{requeued} requeued{}", if *dry_run { " (dry run)" } else { "" });
        }
        DeadLetterCommand::Purge { chosen, yes } => {
            let (selection, dry_run) = (chosen.selection()?, &chosen.dry_run);
            if !*dry_run && !*yes {
                bail!("purged dead letters are gone for good: add --yes (or --dry-run to see which)");
            }
            let mut purged = 0;
            for stream in &streams {
                let chosen: Vec<String> = match &selection {
                    Selection::Ids(ids) => ids.clone(),
                    Selection::Matching(filter) => {
                        dlq::all(&mut conn, stream, filter).await?.into_iter().map(|l| l.id).collect()
                    }
                    _ => dlq::all(&mut conn, stream, &Filter::default()).await?.into_iter().map(|l| l.id).collect(),
                };
                let deleted =
                    if *dry_run { chosen.len() as u64 } else { dlq::purge(&mut conn, stream, &chosen).await? };
                purged += deleted;
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"deadLetterStream": stream, "purged": deleted, "dryRun": dry_run})
                    );
                } else {
                    println!("{stream}\t{deleted} {}", if *dry_run { "would be purged" } else { "purged" });
                }
            }
            eprintln!("{purged} purged{}", if *dry_run { " (dry run)" } else { "" });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<std::ffi::OsString> {
        args.iter().map(Into::into).collect()
    }

    #[test]
    fn as_a_kubectl_plugin_dlq_means_dead_letters() {
        assert_eq!(plugin_args(os(&["/usr/local/bin/kubectl-streamfleet", "dlq", "list"]))[1], "dead-letters");
        assert_eq!(plugin_args(os(&["streamfleet", "dlq"]))[1], "dlq", "only under the plugin's name");
    }

    #[test]
    fn times_are_rfc3339_or_unix_ms() {
        assert_eq!(time_ms("--since", "1700000000000").unwrap(), 1_700_000_000_000);
        assert_eq!(time_ms("--since", "2023-11-14T22:13:20Z").unwrap(), 1_700_000_000_000);
        let refused = time_ms("--since", "yesterday").unwrap_err().to_string();
        assert!(refused.contains("--since") && refused.contains("RFC 3339"), "{refused}");
        assert_eq!(rfc3339(1_700_000_000_000), "2023-11-14T22:13:20Z");
    }
}
