//! The test bed's workload: a tiny process that records what the kubelet
//! stand-in gave it, so tests can assert on real process behaviour.
//!
//! `testproc [run|exit CODE]` with `TESTPROC_DIR` set:
//! * writes `$TESTPROC_DIR/<name>.start` (JSON of its env and args), where
//!   the name is `$TESTPROC_NAME`, else `$HOSTNAME` (the pod name), else the pid;
//! * `run` (default): waits for SIGTERM, writes `.sigterm`, exits 0;
//! * `exit CODE`: exits with CODE at once.
use std::collections::BTreeMap;
use std::path::PathBuf;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = std::env::var_os("TESTPROC_DIR").map(PathBuf::from) else {
        eprintln!("testproc: TESTPROC_DIR is not set");
        return std::process::ExitCode::from(2);
    };
    let name = std::env::var("TESTPROC_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| std::process::id().to_string());
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let record = serde_json::json!({"pid": std::process::id(), "args": args, "env": env});
    if let Err(e) = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{name}.start")), record.to_string()))
    {
        eprintln!("testproc: writing start record: {e}");
        return std::process::ExitCode::from(3);
    }
    match args.first().map(String::as_str) {
        Some("exit") => {
            let code = args.get(1).and_then(|c| c.parse::<u8>().ok()).unwrap_or(0);
            std::process::ExitCode::from(code)
        }
        _ => {
            let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
                return std::process::ExitCode::from(4);
            };
            term.recv().await;
            let _ = std::fs::write(dir.join(format!("{name}.sigterm")), std::process::id().to_string());
            std::process::ExitCode::SUCCESS
        }
    }
}
