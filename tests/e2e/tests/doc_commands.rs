//! The commands the README and `docs/` show, kept true: every command line
//! of a ```` ```sh ```` block is run here against the test bed (changing
//! objects only with `--dry-run=server`, in a namespace of its own standing
//! in for `shop`), or named as run by another test, or listed with why it
//! cannot run on this machine. A command added to the docs that none of
//! these covers fails this test until it is.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use streamfleet_e2e::*;
use streamfleet_testbed::{TestBed, tools};

/// The documents whose commands are checked: the README, the chart's, and
/// every page of `docs/`.
fn docs() -> Vec<String> {
    let mut docs = vec!["README.md".to_string(), "charts/streamfleet/README.md".to_string()];
    let mut pages: Vec<String> = std::fs::read_dir(repo_path("docs"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    pages.sort();
    docs.extend(pages);
    docs
}

/// What covers a command, by how it starts.
enum Cover {
    /// Run here, through `bash`, with the namespaces replaced and
    /// `--dry-run=server` added where the command changes objects.
    Here,
    /// Run as written by another test or by the test command.
    Elsewhere(&'static str),
    /// Cannot run on this machine, and why.
    NotHere(&'static str),
}

const RULES: &[(&str, Cover)] = &[
    (
        "kubectl streamfleet ",
        Cover::Elsewhere("tests/e2e/tests/console.rs runs each, as written, from an isolated host"),
    ),
    ("kubectl get --raw /apis/console", Cover::Elsewhere("tests/e2e/tests/console.rs")),
    ("bash scripts/test.sh", Cover::Elsewhere("the test command itself (.ci/run), and its --quick tier")),
    ("bash scripts/install-deps.sh", Cover::Elsewhere("the test command's first step")),
    ("bash scripts/build-tools.sh", Cover::Elsewhere("the test command's control-plane step")),
    ("STREAMFLEET_IMAGE_REGISTRY=", Cover::Elsewhere("the test command builds the images with it (testbed.local)")),
    ("cargo build --release", Cover::Elsewhere("scripts/build-images.sh, and the benchmarks")),
    (
        "target/release/bench-",
        Cover::NotHere(
            "a benchmark (minutes each, both cores): run by hand, its figure file checked by docs-figures.sh --check",
        ),
    ),
    ("bash scripts/docs-figures.sh", Cover::Elsewhere("the test command (--check)")),
    ("target/tools/bin/crane push", Cover::NotHere("needs a container registry; this machine has none")),
    ("bash scripts/demo.sh", Cover::NotHere("the interactive demo: it starts a test bed and waits for a person")),
    (
        "kubectl krew install",
        Cover::NotHere("krew is not installed here; tests/e2e/tests/images.rs checks the manifest and archive"),
    ),
    ("cargo install", Cover::NotHere("installs into ~/.cargo/bin of whoever runs it")),
    ("ln -s", Cover::NotHere("the workstation step after cargo install")),
    ("kubectl plugin list", Cover::NotHere("lists the workstation's plugins")),
    (
        "kubectl proxy",
        Cover::NotHere("serves until stopped; the console's pages are fetched by tests/e2e/tests/console.rs"),
    ),
    (
        "streamfleet dead-letters",
        Cover::Elsewhere(
            "tests/e2e/tests/recovery.rs and operator/tests/dead_letters_*.rs run the command with these flags",
        ),
    ),
    ("kubectl logs", Cover::NotHere("a Job's log: NAMESPACE and JOB are placeholders")),
    (
        "kubectl -n shop exec",
        Cover::NotHere("needs the quick start's Redis pod, whose volume claim the test bed cannot bind"),
    ),
    ("kubectl", Cover::Here),
    ("helm", Cover::Here),
    ("sed ", Cover::Here),
];

/// Each command line of the ```sh blocks of `doc`, continuation lines
/// joined, comments dropped.
fn commands(doc: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo_path(doc)).unwrap_or_else(|e| panic!("{doc}: {e}"));
    let (mut out, mut in_sh, mut pending) = (Vec::new(), false, String::new());
    for line in text.lines() {
        if line.starts_with("```") {
            in_sh = line == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let line = match line.find(" # ") {
            Some(at) if !line[..at].contains('\'') => &line[..at],
            _ => line,
        };
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => pending.push_str(&format!("{} ", part.trim())),
            None => {
                out.push(format!("{pending}{line}"));
                pending.clear();
            }
        }
    }
    out
}

/// `command` as run here: `shop` and `streamfleet-system` are this test's
/// namespaces, the docs' placeholders name the quick start's pipeline; what
/// changes objects is a server-side dry run; a watch is one look.
fn rewritten(command: &str, shop: &str, system: &str) -> String {
    let mut c = command
        .replace("NAMESPACE", shop)
        .replace("NAME", "orders")
        .replace("<name>", "orders")
        .replace("<total>", "0")
        .replace("create namespace shop", &format!("create namespace {shop}-new"))
        .replace("-n shop ", &format!("-n {shop} "))
        .replace("namespace shop", &format!("namespace {shop}"))
        .replace("-n streamfleet-system", &format!("-n {system}"))
        .replace("--namespace streamfleet-system", &format!("--namespace {system}"))
        .replace(" -w", "");
    let changes =
        ["kubectl apply", "kubectl create", "kubectl label", "kubectl patch", "kubectl delete", "kubectl annotate"];
    let changes_in_ns = [" apply ", " patch ", " delete ", " create "];
    if c.contains("| kubectl apply") {
        // Piped in: into this test's namespace.
        c = c.replace(
            "| kubectl apply",
            &format!("| sed 's/streamfleet-system/{system}/g' | kubectl --dry-run=server apply"),
        );
    } else if changes.iter().any(|v| c.contains(v))
        || (c.starts_with(&format!("kubectl -n {shop}")) && changes_in_ns.iter().any(|v| c.contains(v)))
    {
        c = c.replacen("kubectl ", "kubectl --dry-run=server ", 1);
    }
    // The release exists (set up below): installed again, it is upgraded.
    if c.starts_with("helm install") || c.starts_with("helm upgrade") {
        c = c.replacen("helm install", "helm upgrade --install", 1);
        if !c.contains("--install") {
            c = c.replacen("helm upgrade", "helm upgrade --install", 1);
        }
        c.push_str(" --dry-run=server");
    }
    if c.starts_with("helm uninstall") {
        c.push_str(" --dry-run");
    }
    if c.contains("rollout status") {
        // The quick start's images are not on the test bed: the object is
        // looked up, not waited for.
        c = c.replace("rollout status", "get");
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_in_the_docs_is_run_or_accounted_for() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let shop = bed.namespace(&client, "e2e-docs-shop").await?;
    let system = bed.namespace(&client, "e2e-docs-system").await?;
    // The objects the commands name: a release of the chart (it installs
    // the CRD; no operator replica, this binary's control plane is its
    // own), the quick start's Redis objects and pipeline in `shop`, and the
    // pipeline again in `default` for the commands without a namespace.
    let chart = repo_path("charts/streamfleet").display().to_string();
    let release = ["install", "streamfleet", &chart, "-n", &system.name, "--set", "replicaCount=0"];
    run_ok(bed, "helm", &release, None).await?;
    let crd = "crd/streamconsumergroups.streamfleet.io";
    run_ok(bed, "kubectl", &["wait", "--for=condition=Established", "--timeout=60s", crd], None).await?;
    for (ns, file) in [
        (shop.name.as_str(), "deploy/examples/redis.yaml"),
        (shop.name.as_str(), "deploy/examples/redis-secret.yaml"),
        (shop.name.as_str(), "deploy/examples/order-pipeline.yaml"),
        ("default", "deploy/examples/order-pipeline.yaml"),
    ] {
        let path = repo_path(file).display().to_string();
        run_ok(bed, "kubectl", &["apply", "-n", ns, "-f", &path], None).await?;
    }

    let kubectl = tools::tool("kubectl")?;
    let path = format!(
        "{}:{}:{}",
        kubectl.parent().unwrap().display(),
        tools::tool("helm")?.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let (mut ran, mut elsewhere, mut not_here, mut failures) = (0, 0, 0, Vec::new());
    for doc in &docs() {
        for command in commands(doc) {
            let cover = RULES.iter().find(|(start, _)| command.starts_with(start)).map(|(_, c)| c);
            match cover {
                None => failures.push(format!("{doc}: no test runs `{command}`: run it here or name its test")),
                Some(Cover::Elsewhere(by)) => {
                    elsewhere += 1;
                    println!("{doc}: `{command}`: run by {by}");
                }
                Some(Cover::NotHere(why)) => {
                    not_here += 1;
                    println!("{doc}: `{command}`: not run here: {why}");
                }
                Some(Cover::Here) => {
                    let line = rewritten(&command, &shop.name, &system.name);
                    let out = tokio::process::Command::new("bash")
                        .args(["-c", &line])
                        .current_dir(repo_path("."))
                        .env("PATH", &path)
                        .env("KUBECONFIG", &bed.kubeconfig)
                        .env("HELM_CACHE_HOME", bed.dir.join("helm/cache"))
                        .env("HELM_CONFIG_HOME", bed.dir.join("helm/config"))
                        .env("HELM_DATA_HOME", bed.dir.join("helm/data"))
                        .output()
                        .await?;
                    ran += 1;
                    if !out.status.success() {
                        failures.push(format!(
                            "{doc}: `{command}` (run as `{line}`) failed: {}{}",
                            String::from_utf8_lossy(&out.stdout),
                            String::from_utf8_lossy(&out.stderr)
                        ));
                    }
                }
            }
        }
    }
    println!("doc commands: {ran} run here, {elsewhere} run by other tests, {not_here} not runnable here");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(ran >= 15, "only {ran} commands ran: did the extraction break?");
    run_ok(bed, "kubectl", &["delete", "-n", "default", "scg", "orders"], None).await?;
    Ok(())
}
