//! Prints the StreamConsumerGroup CRD as YAML (or, with `--reference`, the
//! field reference). Its output is committed to `deploy/crds/`,
//! `charts/streamfleet/files/crds/` and `docs/crd-reference.md`; tests fail when
//! they drift.
use std::io::Write;

fn main() -> std::process::ExitCode {
    // `--reference`: the field reference (docs/crd-reference.md) instead.
    let reference = std::env::args().any(|a| a == "--reference");
    let generated = if reference {
        streamfleet_crd::reference_markdown().map_err(|e| e.to_string())
    } else {
        streamfleet_crd::crd_yaml().map_err(|e| e.to_string())
    };
    match generated {
        Ok(yaml) => {
            if std::io::stdout().write_all(yaml.as_bytes()).is_err() {
                return std::process::ExitCode::FAILURE;
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("crdgen: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
