//! The test bed's workload: a tiny process that records what the kubelet
//! stand-in gave it, so tests can assert on real process behaviour.
//!
//! `testproc [run|exit CODE|ignore-term|listen PORT]` with `TESTPROC_DIR` set:
//! * handles SIGTERM, then writes `$TESTPROC_DIR/<name>.start` (JSON of its
//!   pid, env and args), where the name is `$TESTPROC_NAME`, else `$HOSTNAME`
//!   (the pod name), else the pid, and appends the start time (Unix ms) to
//!   `<name>.starts`; a test that waits for the record may signal at once;
//! * `run` (default): waits for SIGTERM, writes `.sigterm`, exits 0;
//! * `exit CODE`: exits with CODE at once;
//! * `ignore-term`: records SIGTERM in `.sigterm` but keeps running (until SIGKILL);
//! * `listen PORT`: like `run`, serving TCP on `$POD_IP:PORT` meanwhile.
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use tokio::signal::unix::{SignalKind, signal};

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
    // The handler before the start record: a test that saw the record may
    // send SIGTERM at once, and an unhandled one would end the process unseen.
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return std::process::ExitCode::from(4);
    };
    if let Err(e) = record_start(&dir, &name, &args) {
        eprintln!("testproc: writing start record: {e}");
        return std::process::ExitCode::from(3);
    }
    let sigterm = dir.join(format!("{name}.sigterm"));
    match args.first().map(String::as_str) {
        Some("exit") => {
            let code = args.get(1).and_then(|c| c.parse::<u8>().ok()).unwrap_or(0);
            std::process::ExitCode::from(code)
        }
        Some("ignore-term") => loop {
            term.recv().await;
            let _ = std::fs::write(&sigterm, std::process::id().to_string());
        },
        Some("listen") => {
            let addr = format!("{}:{}", std::env::var("POD_IP").unwrap_or_default(), args.get(1).map_or("0", |p| p));
            let listener = match tokio::net::TcpListener::bind(&addr).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("testproc: binding {addr}: {e}");
                    return std::process::ExitCode::from(5);
                }
            };
            loop {
                tokio::select! {
                    _ = term.recv() => break,
                    _ = listener.accept() => {}
                }
            }
            let _ = std::fs::write(&sigterm, std::process::id().to_string());
            std::process::ExitCode::SUCCESS
        }
        _ => {
            term.recv().await;
            let _ = std::fs::write(&sigterm, std::process::id().to_string());
            std::process::ExitCode::SUCCESS
        }
    }
}

fn record_start(dir: &Path, name: &str, args: &[String]) -> std::io::Result<()> {
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let record = serde_json::json!({"pid": std::process::id(), "args": args, "env": env});
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(format!("{name}.start")), record.to_string())?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut starts = std::fs::File::options().create(true).append(true).open(dir.join(format!("{name}.starts")))?;
    writeln!(starts, "{}", now.as_millis())
}
