//! Child processes of the test bed: logged to files, killed with the test bed.

use anyhow::{Context as _, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A long-running child (etcd, kube-apiserver, redis-server, ...). Dropping it
/// kills it; if the test process dies first, the kernel kills it too
/// (`PR_SET_PDEATHSIG`), so no server outlives the run.
pub struct Daemon {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Daemon {
    /// Starts `program args` with stdout and stderr appended to `log_dir/name.log`.
    pub fn spawn(name: &str, program: &Path, args: &[String], log_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        let log = log_dir.join(format!("{name}.log"));
        let out = File::options().create(true).append(true).open(&log)?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        die_with_parent(&mut cmd);
        let child = cmd.spawn().with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(Self { name: name.to_string(), child, log })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails with the tail of the log if the process has already exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!("{} exited ({status}); last log lines:\n{}", self.name, self.log_tail(40));
        }
        Ok(())
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        signal(self.child.id(), nix::sys::signal::Signal::SIGTERM);
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(2));
    }
}

pub use nix::sys::signal::Signal;

/// Sends a signal to a process; a process that is already gone is not an error.
pub fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
    }
}

/// Asks the kernel to SIGKILL the child when the thread that spawned it dies,
/// so a crashed or killed test run leaves no servers behind.
pub fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only makes the
    // async-signal-safe prctl(2) call.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
}

/// A free TCP port on 127.0.0.1 (the OS picks it; the tiny window before the
/// server binds it is covered by the callers' start-up retries).
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Waits until something accepts TCP connections on 127.0.0.1:`port`.
pub async fn wait_for_port(port: u16, timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        // A connect to a port nobody listens on can meet itself (TCP
        // simultaneous open, when the kernel picks that port as the local
        // one): that is no listener.
        if let Ok(stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await
            && stream.local_addr().is_ok_and(|local| local.port() != port)
        {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("nothing listening on 127.0.0.1:{port} after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
