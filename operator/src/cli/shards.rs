//! `streamfleet shards` (`kubectl streamfleet shards`): each shard of a
//! pipeline live from Redis, with the worker pods reading it and the
//! entries waiting for a retry.

use super::{ConsoleClient, Output, print};
use crate::console::wire::{Shard, ShardList};
use anyhow::Result;

#[derive(clap::Args)]
pub struct ShardsArgs {
    /// The pipeline, `namespace/name`, reached through the Kubernetes API
    /// server with your kubeconfig (the console's `view` role).
    #[arg(long)]
    pipeline: String,
    /// `text` (default) or `json` (one shard per line).
    #[arg(long, short = 'o', default_value = "text")]
    output: Output,
}

/// A shard, then a line per consumer and per retry step, indented.
fn text(s: &Shard) -> String {
    if !s.group_exists {
        return format!("{}\tno group yet", s.stream);
    }
    let known = |v: Option<u64>, unit: &str| v.map_or_else(|| "unknown".to_string(), |v| format!("{v}{unit}"));
    let lag = format!("{}{}", if s.lag_at_least { "≥" } else { "" }, known(s.lag, ""));
    let mut lines = vec![format!(
        "{}\tlag {lag}\tpending {} ({} retrying)\tdelay {}\tlength {}\tdead letters {}",
        s.stream,
        s.pending,
        s.retrying,
        known(s.delay_seconds, "s"),
        s.stream_length,
        s.dead_letters
    )];
    for c in &s.consumers {
        lines.push(format!("  consumer {}\tpending {}\tidle {}s", c.name, c.pending, c.idle_ms / 1000));
    }
    for r in &s.retries {
        lines.push(format!(
            "  retry after delivery {}\t{} entries\twaiting up to {}s\t{}",
            r.after_delivery,
            r.entries,
            r.longest_wait_ms / 1000,
            r.last_error.as_deref().unwrap_or("-")
        ));
    }
    lines.join("\n")
}

pub async fn run(args: ShardsArgs) -> Result<()> {
    let console = ConsoleClient::open(&args.pipeline).await?;
    let list: ShardList = console.get("shards").await?;
    for shard in &list.items {
        print(args.output, shard, text(shard));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::console::wire::ShardConsumer;

    #[test]
    fn unknown_figures_are_said_unknown() {
        let shard = Shard {
            stream: "orders".into(),
            group_exists: true,
            lag: None,
            pending: 2,
            consumers: vec![ShardConsumer { name: "w-1".into(), pending: 2, idle_ms: 3_500 }],
            ..Shard::default()
        };
        let out = text(&shard);
        assert!(out.starts_with("orders\tlag unknown\tpending 2 (0 retrying)\tdelay unknown"), "{out}");
        assert!(out.contains("\n  consumer w-1\tpending 2\tidle 3s"), "{out}");
        assert_eq!(text(&Shard { stream: "s".into(), ..Shard::default() }), "s\tno group yet");
    }
}
