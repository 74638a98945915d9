//! `streamfleet dead-letters` (`kubectl streamfleet dlq`): list, show,
//! count, replay and purge a pipeline's dead letters.
//!
//! By default it goes through the Kubernetes API server to the console API
//! with the caller's kubeconfig: it works wherever `kubectl` does, with no
//! Redis URL or password on the laptop, and the caller's RBAC decides.
//! `--redis-url` talks to Redis directly (break-glass: the console down).

use super::{ConsoleClient, Output, print};
use crate::console::letters::{Action, Letters};
use crate::console::wire::{ActionRequest, ActionResult, FilterSpec, Letter, LetterList, LetterStats};
use anyhow::{Context as _, Result, bail};
use streamfleet_streams::{ClientTls, Endpoint, Mode, StreamConnection};

#[derive(clap::Args)]
pub struct DeadLetterArgs {
    /// The pipeline, `namespace/name`, reached through the Kubernetes API
    /// server with your kubeconfig (you need the console's `view` role in
    /// that namespace; `edit` to see payloads, replay or purge). Wins over
    /// the break-glass flags and their environment variables.
    #[arg(long, global = true)]
    pipeline: Option<String>,
    /// Break-glass: this Redis URL (credentials in it, or given apart) instead of the console.
    #[arg(long, global = true, env = "STREAMFLEET_REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// Break-glass: the ACL user, when the URL carries no credentials.
    #[arg(long, global = true, env = "STREAMFLEET_REDIS_USERNAME")]
    redis_username: Option<String>,
    /// Break-glass: the password, as it is (no percent-encoding), from this
    /// environment variable only: a flag would put it in the shell's history.
    #[arg(skip = std::env::var("STREAMFLEET_REDIS_PASSWORD").ok().filter(|p| !p.is_empty()))]
    redis_password: Option<String>,
    /// Break-glass: treat the URL as a Redis Cluster node.
    #[arg(long, global = true)]
    cluster: bool,
    /// Break-glass: PEM CA bundle that signs a `rediss://` server's certificate.
    #[arg(long, global = true)]
    ca_file: Option<std::path::PathBuf>,
    /// Break-glass: PEM client certificate, for a server that asks for one
    /// (`tls-auth-clients yes`); with `--client-key-file`.
    #[arg(long, global = true, requires = "client_key_file")]
    client_cert_file: Option<std::path::PathBuf>,
    /// Break-glass: the client certificate's PEM private key.
    #[arg(long, global = true, requires = "client_cert_file")]
    client_key_file: Option<std::path::PathBuf>,
    /// Break-glass: the dead-letter stream, e.g. `{orders}:dead:billing`.
    #[arg(long, global = true, env = "STREAMFLEET_DEAD_LETTER_STREAM")]
    dead_letter_stream: Option<String>,
    /// `text` (default) or `json` (one object per line).
    #[arg(long, short = 'o', global = true, default_value = "text")]
    output: Output,
    #[command(subcommand)]
    command: DeadLetterCommand,
}

/// Which letters (every condition must hold).
#[derive(clap::Args, Clone, Default)]
struct FilterArgs {
    /// Only these reasons (comma-separated): permanent, malformed, retries-exhausted, max-deliveries,
    /// payload-missing, crashed-worker.
    #[arg(long)]
    reason: Option<String>,
    /// Dead-lettered at or after: RFC 3339 (`2026-12-01T10:00:00Z`) or Unix ms.
    #[arg(long)]
    since: Option<String>,
    /// Dead-lettered before: RFC 3339 or Unix ms.
    #[arg(long)]
    until: Option<String>,
    /// Only this business key.
    #[arg(long)]
    key: Option<String>,
    /// Only letters whose error contains this text (case-insensitive).
    #[arg(long)]
    error: Option<String>,
    /// First dead-letter ID (inclusive).
    #[arg(long)]
    from: Option<String>,
    /// Last dead-letter ID (inclusive).
    #[arg(long)]
    to: Option<String>,
}

impl FilterArgs {
    fn spec(&self) -> Result<FilterSpec> {
        let spec = FilterSpec {
            reason: self.reason.clone(),
            since: self.since.clone(),
            until: self.until.clone(),
            key: self.key.clone(),
            error: self.error.clone(),
            from: self.from.clone(),
            to: self.to.clone(),
        };
        // Refused here, naming the flag, before anything is sent.
        spec.filter().map_err(|e| anyhow::anyhow!("--{e:#}"))?;
        Ok(spec)
    }
}

/// Which letters `replay` and `purge` act on: IDs, a filter, or all of them.
#[derive(clap::Args, Clone)]
struct ChosenArgs {
    /// Dead letters (comma-separated), as listings print them: the ID, or
    /// `<dead-letter stream>@<ID>` when the pipeline has shards.
    #[arg(long, value_delimiter = ',', conflicts_with = "all")]
    ids: Vec<String>,
    #[command(flatten)]
    filter: FilterArgs,
    /// Every dead letter.
    #[arg(long)]
    all: bool,
    /// Say how many would be taken, change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Refuse when more than this many letters are chosen (default 1000).
    #[arg(long)]
    max: Option<u64>,
}

impl ChosenArgs {
    fn request(&self) -> Result<ActionRequest> {
        let request = ActionRequest {
            ids: self.ids.clone(),
            filter: self.filter.spec()?,
            all: self.all,
            dry_run: self.dry_run,
            max: self.max,
        };
        // Never everything by default, and one way: the user says which.
        crate::console::letters::selection(&request).map_err(|_| {
            anyhow::anyhow!(
                "say which, one way: --ids, a filter (--reason, --since, --until, --key, --error, --from, --to), or --all"
            )
        })?;
        Ok(request)
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
        /// Read the page after this cursor (the previous page's last line).
        #[arg(long)]
        after: Option<String>,
    },
    /// One dead letter in full: metadata and original fields.
    Show {
        /// The dead letter, as listings print it: the ID, or
        /// `<dead-letter stream>@<ID>` when the pipeline has shards.
        id: String,
    },
    /// Counts by reason, by hour and by error signature.
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

/// Where the letters are read and changed.
enum Backend {
    /// The console API, through the API server.
    Console(ConsoleClient),
    /// Redis itself (break-glass).
    Redis(Letters),
}

impl Backend {
    async fn open(args: &DeadLetterArgs) -> Result<Self> {
        if let Some(pipeline) = &args.pipeline {
            return Ok(Self::Console(ConsoleClient::open(pipeline).await?));
        }
        let url = args
            .redis_url
            .clone()
            .context("say which pipeline: --pipeline NAMESPACE/NAME (or, break-glass, --redis-url)")?;
        let stream = args.dead_letter_stream.clone().context("--dead-letter-stream (or --pipeline)")?;
        let read = |flag: &str, path: &Option<std::path::PathBuf>| match path {
            Some(path) => std::fs::read(path).with_context(|| format!("{flag} {}", path.display())).map(Some),
            None => Ok(None),
        };
        let ca_pem = read("--ca-file", &args.ca_file)?;
        let client_tls = match (
            read("--client-cert-file", &args.client_cert_file)?,
            read("--client-key-file", &args.client_key_file)?,
        ) {
            (Some(cert_pem), Some(key_pem)) => Some(ClientTls { cert_pem, key_pem }),
            _ => None,
        };
        let mode = if args.cluster { Mode::Cluster } else { Mode::Standalone };
        let endpoint = Endpoint {
            ca_pem,
            client_tls,
            username: args.redis_username.clone(),
            password: args.redis_password.clone(),
            ..Endpoint::new(url, mode)
        };
        let conn = StreamConnection::connect(&endpoint).await?;
        Ok(Self::Redis(Letters { conn, streams: vec![stream] }))
    }

    async fn list(&mut self, filter: &FilterSpec, after: Option<&str>, limit: usize) -> Result<LetterList> {
        match self {
            Self::Console(console) => {
                let mut query = serde_urlencoded::to_string(filter)?;
                query.push_str(&format!("&limit={limit}"));
                if let Some(after) = after {
                    query.push_str(&format!("&{}", serde_urlencoded::to_string([("continue", after)])?));
                }
                console.get(&format!("deadletters?{query}")).await
            }
            Self::Redis(letters) => letters.list(&filter.filter()?, after, limit, usize::MAX).await,
        }
    }

    async fn show(&mut self, id: &str) -> Result<Option<Letter>> {
        match self {
            Self::Console(console) => {
                // `{`, `}`, `:` and `@` of `<stream>@<ID>` as one path segment.
                let id = percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC);
                let Some(letter) = console.get_opt::<Letter>(&format!("deadletters/{id}"), "no dead letter").await?
                else {
                    return Ok(None);
                };
                // The payload is a right of its own (the `edit` role's).
                match console.get_opt::<Letter>(&format!("payloads/{id}"), "no dead letter").await {
                    Ok(Some(full)) => Ok(Some(full)),
                    Ok(None) => Ok(Some(letter)),
                    Err(e) => {
                        eprintln!("payload not shown: {e:#}");
                        Ok(Some(letter))
                    }
                }
            }
            Self::Redis(letters) => letters.show(id, true).await,
        }
    }

    async fn stats(&mut self, filter: &FilterSpec) -> Result<LetterStats> {
        match self {
            Self::Console(console) => {
                console.get(&format!("deadletterstats?{}", serde_urlencoded::to_string(filter)?)).await
            }
            Self::Redis(letters) => letters.stats(&filter.filter()?, usize::MAX).await,
        }
    }

    async fn act(&mut self, action: Action, request: &ActionRequest) -> Result<ActionResult> {
        match self {
            Self::Console(console) => {
                let verb = match action {
                    Action::Replay => "replay",
                    Action::Purge => "purge",
                };
                console.post(verb, request).await
            }
            Self::Redis(letters) => letters.act(action, request).await.map_err(|stopped| {
                let done = stopped.result.done;
                stopped.error.context(format!("stopped after {done} done"))
            }),
        }
    }
}

fn letter_line(l: &Letter) -> String {
    let or_dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    format!(
        "{}\t{}\t{}\t{} {}\tkey={}\t{}",
        l.reference,
        l.at,
        or_dash(&l.reason),
        or_dash(&l.source_stream),
        or_dash(&l.source_id),
        or_dash(&l.business_key),
        or_dash(&l.error)
    )
}

pub async fn run(args: DeadLetterArgs) -> Result<()> {
    let mut backend = Backend::open(&args).await?;
    let print = |value: &dyn super::ToJson, text: String| print(args.output, value, text);
    match &args.command {
        DeadLetterCommand::List { filter, limit, after } => {
            let list = backend.list(&filter.spec()?, after.as_deref(), *limit).await?;
            for l in &list.items {
                print(l, letter_line(l));
            }
            if let Some(cursor) = list.continue_ {
                eprintln!("more: --after {cursor}");
            }
        }
        DeadLetterCommand::Show { id } => {
            let l = backend.show(id).await?.with_context(|| format!("no dead letter {id}"))?;
            let mut text = letter_line(&l);
            text.push_str(&format!(
                "\ngroup={} consumer={} deliveries={}",
                l.group.clone().unwrap_or_default(),
                l.consumer.clone().unwrap_or_default(),
                l.deliveries.unwrap_or(0)
            ));
            for (k, v) in l.payload.iter().flatten() {
                text.push_str(&format!("\n  {k} = {v}"));
            }
            print(&l, text);
        }
        DeadLetterCommand::Stats { filter } => {
            let stats = backend.stats(&filter.spec()?).await?;
            let mut lines = vec![format!("total\t{}", stats.total)];
            lines.extend(stats.by_reason.iter().map(|(r, n)| format!("reason\t{r}\t{n}")));
            lines.extend(stats.by_hour.iter().map(|(h, n)| format!("hour\t{h}\t{n}")));
            lines.extend(stats.by_error.iter().map(|(e, n)| format!("error\t{n}\t{e}")));
            print(&stats, lines.join("\n"));
            if !stats.complete {
                eprintln!(
                    "counted up to the console's read bound: narrow the filter (--since, --reason) for exact counts"
                );
            }
        }
        DeadLetterCommand::Replay { chosen } => {
            let result = backend.act(Action::Replay, &chosen.request()?).await?;
            let mut lines: Vec<String> = result
                .requeued
                .iter()
                .map(|r| {
                    format!(
                        "requeued {} -> {} {} key={}",
                        r.dead_letter_id,
                        r.source_stream,
                        r.new_id,
                        r.business_key.clone().unwrap_or_default()
                    )
                })
                .collect();
            lines.extend(result.skipped.iter().map(|s| format!("skipped {}: {}", s.dead_letter_id, s.why)));
            print(&result, lines.join("\n"));
            eprintln!(
                "{} of {} requeued{}",
                result.done,
                result.matched,
                if result.dry_run { " (dry run)" } else { "" }
            );
        }
        DeadLetterCommand::Purge { chosen, yes } => {
            let request = chosen.request()?;
            if !request.dry_run && !*yes {
                bail!("purged dead letters are gone for good: add --yes (or --dry-run to count them)");
            }
            let result = backend.act(Action::Purge, &request).await?;
            let word = if result.dry_run { "would be purged" } else { "purged" };
            print(&result, format!("{} {word}", result.done));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: DeadLetterArgs,
    }

    #[test]
    fn the_pipeline_goes_before_or_after_the_subcommand() {
        for line in [
            &["dlq", "--pipeline", "shop/orders", "stats"][..],
            &["dlq", "stats", "--pipeline", "shop/orders"],
            &["dlq", "-o", "json", "stats", "--reason", "permanent", "--pipeline", "shop/orders"],
        ] {
            let cli = Cli::try_parse_from(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
            assert_eq!(cli.args.pipeline.as_deref(), Some("shop/orders"), "{line:?}");
        }
    }

    #[test]
    fn a_bad_time_names_its_flag() {
        let args = FilterArgs { since: Some("yesterday".into()), ..FilterArgs::default() };
        let refused = format!("{:#}", args.spec().err().unwrap_or_else(|| anyhow::anyhow!("accepted")));
        assert!(refused.starts_with("--since") && refused.contains("RFC 3339"), "{refused}");
    }

    #[test]
    fn an_action_says_which_letters() {
        let chosen = ChosenArgs { ids: vec![], filter: FilterArgs::default(), all: false, dry_run: false, max: None };
        assert!(chosen.request().is_err());
        let all = ChosenArgs { all: true, ..chosen.clone() };
        assert!(all.request().is_ok_and(|r| r.all));
        let two = ChosenArgs {
            ids: vec!["1-0".into()],
            filter: FilterArgs { reason: Some("malformed".into()), ..FilterArgs::default() },
            ..chosen
        };
        assert!(two.request().is_err(), "IDs and a filter: which one?");
    }
}
