//! `streamfleet pause` / `resume` (`kubectl streamfleet pause`): stop a
//! pipeline's workers and recovery runs (`spec.suspend`) and start them
//! again, through the console with your kubeconfig; an Event names you.

use super::{ConsoleClient, Output, print};
use crate::console::wire::Suspension;
use anyhow::Result;

#[derive(clap::Args)]
pub struct SuspendArgs {
    /// The pipeline, `namespace/name` (you need the console's `edit` role).
    #[arg(long)]
    pipeline: String,
    /// `text` (default) or `json`.
    #[arg(long, short = 'o', default_value = "text")]
    output: Output,
}

pub async fn run(args: SuspendArgs, pause: bool) -> Result<()> {
    let console = ConsoleClient::open(&args.pipeline).await?;
    let verb = if pause { "pause" } else { "resume" };
    let done: Suspension = console.post(verb, &serde_json::json!({})).await?;
    let text = match (done.suspended, done.changed) {
        (true, true) => format!("{} paused: no workers, no recovery runs", args.pipeline),
        (true, false) => format!("{} was already paused", args.pipeline),
        (false, true) => format!("{} resumed", args.pipeline),
        (false, false) => format!("{} was not paused", args.pipeline),
    };
    print(args.output, &done, text);
    Ok(())
}
