//! Prints the StreamConsumerGroup CRD as YAML. Its output is committed to
//! `deploy/crds/` and `charts/streamfleet/crds/`; a test fails when they drift.
use std::io::Write;

fn main() -> std::process::ExitCode {
    match streamfleet_crd::crd_yaml() {
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
