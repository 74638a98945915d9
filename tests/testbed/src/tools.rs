//! Where the test bed finds its binaries.
//!
//! The Go-built components (etcd, kube-apiserver, kube-controller-manager,
//! kubectl, helm) are linked into `target/tools/bin` by
//! `scripts/build-tools.sh`; `STREAMFLEET_TOOLS_BIN` overrides that folder.
//! The project's own binaries sit in the cargo target folder beside the
//! running executable (`target/debug`, or its parent for a test binary in
//! `target/debug/deps`).

use anyhow::{Context as _, Result, bail};
use std::path::{Path, PathBuf};

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A Go-built tool such as `kube-apiserver`.
pub fn tool(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os("STREAMFLEET_TOOLS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/tools/bin"));
    let path = dir.join(name);
    if !path.exists() {
        bail!("{} not found; run scripts/build-tools.sh (or set STREAMFLEET_TOOLS_BIN)", path.display());
    }
    Ok(path)
}

/// A system binary such as `redis-server`, searched on PATH.
pub fn system(name: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} not on PATH; run scripts/install-deps.sh"))
}

/// The cargo target folder holding this workspace's binaries.
pub fn cargo_bin_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running executable")?;
    let mut dir = exe.parent().context("executable has no folder")?.to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir)
}

/// One of this workspace's binaries, e.g. `testproc`; built by `cargo build --workspace --bins`.
pub fn cargo_bin(name: &str) -> Result<PathBuf> {
    let path = cargo_bin_dir()?.join(name);
    if !path.is_file() {
        bail!("{} not built; run `cargo build --workspace --bins`", path.display());
    }
    Ok(path)
}
