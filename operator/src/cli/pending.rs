//! `streamfleet pending` (`kubectl streamfleet pending`): a pipeline's
//! in-flight entries, a page at a time: who holds each, for how long,
//! after how many deliveries, whether it waits for a retry, its last error.

use super::{ConsoleClient, Output, print};
use crate::console::wire::{PendingEntry, PendingList, PendingQuery};
use anyhow::{Context as _, Result};

#[derive(clap::Args)]
pub struct PendingArgs {
    /// The pipeline, `namespace/name`, reached through the Kubernetes API
    /// server with your kubeconfig (the console's `view` role).
    #[arg(long)]
    pipeline: String,
    /// Only this consumer's entries (a worker pod's name).
    #[arg(long)]
    consumer: Option<String>,
    /// Only entries idle at least this long: `90s`, `5m`, `2h`, or milliseconds.
    #[arg(long)]
    min_idle: Option<String>,
    /// Entries per page (at most 500).
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// Read the page after this cursor (the previous page's last line).
    #[arg(long)]
    after: Option<String>,
    /// `text` (default) or `json` (one object per line).
    #[arg(long, short = 'o', default_value = "text")]
    output: Output,
}

/// `90s`, `5m`, `2h`, `1d`, or plain milliseconds.
fn duration_ms(text: &str) -> Result<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().with_context(|| format!("--min-idle {text:?}: a number, then s, m, h or d"))?;
    let scale = match unit {
        "" | "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => anyhow::bail!("--min-idle {text:?}: the unit is s, m, h or d"),
    };
    Ok(n.saturating_mul(scale))
}

fn line(e: &PendingEntry) -> String {
    let state = match e.retry_after_delivery {
        Some(n) => format!("retrying after delivery {n}"),
        None => format!("held by {}", e.consumer),
    };
    format!(
        "{}\t{}\t{state}\tidle {}s\tdeliveries {}\t{}",
        e.stream,
        e.id,
        e.idle_ms / 1000,
        e.deliveries,
        e.last_error.as_deref().unwrap_or("-")
    )
}

pub async fn run(args: PendingArgs) -> Result<()> {
    let query = PendingQuery {
        consumer: args.consumer.clone(),
        min_idle_ms: args.min_idle.as_deref().map(duration_ms).transpose()?,
        limit: Some(args.limit),
        continue_: args.after.clone(),
    };
    let console = ConsoleClient::open(&args.pipeline).await?;
    let list: PendingList = console.get(&format!("pending?{}", serde_urlencoded::to_string(&query)?)).await?;
    for e in &list.items {
        print(args.output, e, line(e));
    }
    if let Some(cursor) = list.continue_ {
        eprintln!("more: --after {cursor}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_times_take_units() {
        assert_eq!(duration_ms("90s").ok(), Some(90_000));
        assert_eq!(duration_ms("5m").ok(), Some(300_000));
        assert_eq!(duration_ms("1500").ok(), Some(1500));
        assert!(duration_ms("5 weeks").is_err());
        assert!(duration_ms("m").is_err());
    }
}
