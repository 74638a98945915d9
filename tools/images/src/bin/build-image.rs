//! `build-image --binary PATH --reference REF --out DIR [--label K=V]...`:
//! writes a single-binary OCI image layout (see `streamfleet_images`) and
//! prints `<reference> <manifest digest>`. Used by `scripts/build-images.sh`.

use anyhow::{Context as _, Result};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
struct Args {
    /// The static binary to run as the entrypoint.
    #[arg(long)]
    binary: PathBuf,
    /// Its path in the image (`/<name>`); defaults to the binary's file name.
    #[arg(long)]
    name: Option<String>,
    /// The reference the layout tags the image with, e.g. `ghcr.io/acme/streamfleet:0.1.0`.
    #[arg(long)]
    reference: String,
    /// A label, `key=value` (repeatable).
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// CA roots installed as `/etc/ssl/certs/ca-certificates.crt` (for `rediss://`).
    #[arg(long, default_value = "/etc/ssl/certs/ca-certificates.crt")]
    ca_roots: PathBuf,
    /// Every timestamp in the image, in seconds since the epoch.
    #[arg(long, env = "SOURCE_DATE_EPOCH", default_value_t = 0)]
    epoch: u64,
    /// The OCI layout folder to write (replaced).
    #[arg(long)]
    out: PathBuf,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?} is not key=value"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let name = match &args.name {
        Some(n) => n.clone(),
        None => args.binary.file_name().context("--binary has no file name")?.to_string_lossy().into_owned(),
    };
    let spec = streamfleet_images::ImageSpec {
        binary: &args.binary,
        name: &name,
        reference: &args.reference,
        labels: &args.labels,
        ca_roots: args.ca_roots.exists().then_some(args.ca_roots.as_path()),
        epoch: args.epoch,
    };
    let written = streamfleet_images::write_layout(&spec, &args.out)?;
    println!("{} {}", args.reference, written.manifest_digest);
    Ok(())
}
