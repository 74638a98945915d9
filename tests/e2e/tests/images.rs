//! The images `scripts/build-images.sh` builds (the test command runs it with
//! `STREAMFLEET_IMAGE_REGISTRY=testbed.local` beside the other tests; this
//! one waits for them): valid OCI as
//! a real registry client sees it, static, non-root, without a shell; and the
//! operator and a worker run in the test bed from the images' own
//! filesystems (the kubelet stand-in unpacks an image of `target/images` and
//! runs its entrypoint as its user).

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt as _};
use redis::AsyncCommands as _;
use std::path::PathBuf;
use std::time::Duration;
use streamfleet_e2e::*;
use streamfleet_images::{Image, USER, read_layout};
use streamfleet_testbed::{eventually, tools};

const REGISTRY: &str = "testbed.local";
const T: Duration = Duration::from_secs(120);

fn image(name: &str) -> Result<Image> {
    let layout = repo_path(&format!("target/images/{name}"));
    let mut images = read_layout(&layout)
        .with_context(|| format!("{}: run scripts/build-images.sh (the test command does)", layout.display()))?;
    anyhow::ensure!(images.len() == 1, "{} images in {}", images.len(), layout.display());
    Ok(images.remove(0))
}

fn reference(name: &str) -> String {
    format!("{REGISTRY}/{name}:{}", env!("CARGO_PKG_VERSION"))
}

/// True when the ELF file has no program interpreter (`PT_INTERP`): it needs no libc in the image.
fn is_static_elf(bytes: &[u8]) -> bool {
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
    assert_eq!(&bytes[..5], b"\x7fELF\x02", "not a 64-bit ELF");
    let (phoff, phentsize, phnum) = (u64_at(0x20) as usize, u16_at(0x36) as usize, u16_at(0x38) as usize);
    (0..phnum).all(|i| u32_at(phoff + i * phentsize) != 3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_images_are_valid_oci_static_non_root_and_have_no_shell() -> Result<()> {
    let crane = tools::tool("crane")?;
    let port = streamfleet_testbed::process::free_port()?;
    let logs = tempfile::tempdir()?;
    let _registry = streamfleet_testbed::process::Daemon::spawn(
        "crane-registry",
        &crane,
        &["registry".into(), "serve".into(), "--address".into(), format!("127.0.0.1:{port}")],
        logs.path(),
    )?;
    streamfleet_testbed::process::wait_for_port(port, Duration::from_secs(30)).await?;
    let crane_ok = |args: Vec<String>| {
        let out = std::process::Command::new(&crane).args(&args).output().unwrap();
        assert!(out.status.success(), "crane {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    for name in ["streamfleet", "example-worker"] {
        let image = image(name)?;
        assert_eq!(image.reference, reference(name));
        assert_eq!(image.entrypoint(), [format!("/{name}")]);
        assert_eq!(image.user(), Some((USER, USER)), "{name} runs as root");
        let labels = &image.config["Labels"];
        assert_eq!(labels["org.opencontainers.image.title"], name);
        assert_eq!(labels["org.opencontainers.image.version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
        let revision = labels["org.opencontainers.image.revision"].as_str().unwrap_or_default();
        assert!(revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit()), "revision {revision:?}");

        let paths = streamfleet_images::list_paths(&image)?;
        assert!(!paths.iter().any(|p| p.starts_with("bin") || p.starts_with("usr") || p.ends_with("sh")), "{paths:?}");
        let rootfs = tempfile::tempdir()?;
        streamfleet_images::unpack(&image, rootfs.path())?;
        let binary = std::fs::read(rootfs.path().join(name))?;
        assert!(is_static_elf(&binary), "{name} needs a dynamic loader the image does not have");
        let passwd = std::fs::read_to_string(rootfs.path().join("etc/passwd"))?;
        assert!(passwd.contains(&format!("nonroot:x:{USER}:{USER}:")), "{passwd}");
        assert!(rootfs.path().join("etc/ssl/certs/ca-certificates.crt").is_file(), "no CA roots for rediss://");

        // A real registry client takes the layout as it is: pushed, validated,
        // and read back with the same digest and config.
        let remote = format!("127.0.0.1:{port}/streamfleet/{name}:test");
        let layout = repo_path(&format!("target/images/{name}")).display().to_string();
        crane_ok(vec!["push".into(), layout, remote.clone()]);
        crane_ok(vec!["validate".into(), "--remote".into(), remote.clone()]);
        assert_eq!(crane_ok(vec!["digest".into(), remote.clone()]), image.manifest_digest);
        let config: serde_json::Value = serde_json::from_str(&crane_ok(vec!["config".into(), remote]))?;
        assert_eq!(config["config"], image.config);
        println!("{} {}", image.reference, image.manifest_digest);
    }
    Ok(())
}

/// The pod's first container process: its executable and its uid.
fn process_of(pod: &Pod) -> Result<(PathBuf, u32)> {
    let container = pod.spec.as_ref().and_then(|s| s.containers.first()).map(|c| c.name.clone()).unwrap_or_default();
    let pid = streamfleet_testbed::kubelet::container_pid(pod, &container).context("no process")?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no Uid line")?;
    Ok((exe, uid))
}

async fn running_pod(client: &Client, ns: &str, selector: &str) -> Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    eventually(&format!("a running pod {selector}"), T, || async {
        let list = pods.list(&ListParams::default().labels(selector)).await?;
        Ok(list.items.into_iter().find(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|s| s.first())
                .is_some_and(|s| s.ready)
        }))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_and_a_worker_run_from_their_images_as_non_root() -> Result<()> {
    let repository = format!("{REGISTRY}/streamfleet");
    let set_repository = format!("image.repository={repository}");
    let set_tag = format!("image.tag={}", env!("CARGO_PKG_VERSION"));
    let f = Fixture::start("e2e-images", &["--set", &set_repository, "--set", &set_tag]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    // The process runs the image's own entrypoint: byte for byte the binary in its layer.
    let from_image = |exe: &std::path::Path, name: &str| -> Result<bool> {
        let rootfs = tempfile::tempdir()?;
        streamfleet_images::unpack(&image(name)?, rootfs.path())?;
        Ok(std::fs::read(exe)? == std::fs::read(rootfs.path().join(name))?)
    };

    let operator = running_pod(&client, &ns, "app.kubernetes.io/name=streamfleet-operator").await?;
    let (exe, uid) = process_of(&operator)?;
    assert!(from_image(&exe, "streamfleet")?, "the operator runs {}, not the image's binary", exe.display());
    assert_eq!(uid, USER, "the operator runs as uid {uid}");

    let mut conn = f.conn.clone();
    for i in 0..100 {
        let _: String =
            conn.xadd("orders", "*", &[("order_id", i.to_string()), ("amount_cents", "100".into())]).await?;
    }
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}";
    f.apply(&manifest("orders", "orders", "billing", &reference("example-worker"), &[], spec)).await?;
    let worker = running_pod(&client, &ns, "app.kubernetes.io/component=worker").await?;
    let (exe, uid) = process_of(&worker)?;
    assert!(from_image(&exe, "example-worker")?, "the worker runs {}, not the image's binary", exe.display());
    assert_eq!(uid, USER, "the worker runs as uid {uid}");
    eventually("every order charged by the image's worker", T, || async {
        let charged: usize = f.redis.connection().await?.hlen("{ledger}:charges").await?;
        Ok((charged == 100).then_some(()))
    })
    .await?;
    wait_condition(&client, &ns, "orders", "Ready", "True", None, T).await?;
    println!("operator {} and worker {} ran from their images as uid {USER}", operator.name_any(), worker.name_any());
    Ok(())
}

/// Answers every A query with 127.0.0.1 (and others with no answer) on
/// `addr`: enough DNS for a name such as `redis.shop.svc.cluster.local`.
async fn serve_dns(socket: tokio::net::UdpSocket) {
    let mut buf = [0u8; 512];
    while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
        let query = &buf[..n];
        let Some(name_end) = query.get(12..).and_then(|q| q.iter().position(|b| *b == 0)) else { continue };
        let question = &query[12..12 + name_end + 5];
        let is_a = question[question.len() - 4..question.len() - 2] == [0, 1];
        let mut reply = query[..2].to_vec();
        reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, u8::from(is_a), 0, 0, 0, 0]);
        reply.extend_from_slice(question);
        if is_a {
            reply.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 127, 0, 0, 1]);
        }
        let _ = socket.send_to(&reply, peer).await;
    }
}

/// The static binaries resolve names from inside the image alone (glibc's
/// built-in `files` and `dns`): the example worker, chrooted into its
/// image's filesystem as uid 65532 with only what a container gets added (a
/// `resolv.conf` from the kubelet, `/dev` from the runtime), reaches Redis by
/// a cluster DNS name and charges an order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_binary_in_its_image_resolves_a_cluster_dns_name() -> Result<()> {
    let image = image("example-worker")?;
    let root = tempfile::tempdir()?;
    streamfleet_images::unpack(&image, root.path())?;
    // Reachable by uid 65532: the chroot and the path to it.
    std::fs::set_permissions(root.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let dns = tokio::net::UdpSocket::bind("127.0.0.77:53").await?;
    tokio::spawn(serve_dns(dns));
    std::fs::write(root.path().join("etc/resolv.conf"), "nameserver 127.0.0.77\n")?;
    // What a container runtime provides in every container: the basic devices.
    std::fs::create_dir(root.path().join("dev"))?;
    for (name, minor) in [("null", "3"), ("zero", "5"), ("random", "8"), ("urandom", "9")] {
        let node = root.path().join("dev").join(name);
        let made =
            std::process::Command::new("mknod").arg("-m").arg("666").arg(&node).args(["c", "1", minor]).status()?;
        assert!(made.success(), "mknod {}", node.display());
    }
    let redis = streamfleet_testbed::RedisServer::start().await?;
    let mut conn = redis.connection().await?;
    streamfleet_streams::ensure_group(&mut conn, "orders", "billing", "0").await?;
    let _: String = conn.xadd("orders", "*", &[("order_id", "1"), ("amount_cents", "100")]).await?;
    let url = format!("redis://redis.shop.svc.cluster.local:{}/", redis.port);
    let mut worker = tokio::process::Command::new("/usr/sbin/chroot")
        .arg(format!("--userspec={USER}:{USER}"))
        .arg(root.path())
        .arg(&image.entrypoint()[0])
        .env_clear()
        .envs([
            ("STREAMFLEET_REDIS_URL", url.as_str()),
            ("STREAMFLEET_STREAMS", "orders"),
            ("STREAMFLEET_GROUP", "billing"),
            ("STREAMFLEET_CONSUMER", "from-the-image"),
        ])
        .kill_on_drop(true)
        .spawn()?;
    let charged = eventually("the order charged by the chrooted worker", Duration::from_secs(30), || async {
        let by: Option<String> = redis.connection().await?.hget("{ledger}:charged-by", "1").await?;
        Ok(by)
    })
    .await;
    let _ = worker.kill().await;
    assert_eq!(charged?, "from-the-image");
    Ok(())
}

/// The CLI for workstations, as `scripts/package-cli.sh` packs it (the test
/// command runs it inside `build-images.sh`): a static binary and LICENSE in
/// a reproducible archive, whose checksum the krew manifest carries; krew
/// installs it from that manifest exactly as `docs/dead-letters.md` shows,
/// and kubectl then finds and runs it as the `streamfleet` plugin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_archive_installs_with_krew_and_runs_as_a_kubectl_plugin() -> Result<()> {
    let dist = repo_path("target/dist");
    let name = format!("streamfleet_{}_linux_amd64.tar.gz", env!("CARGO_PKG_VERSION"));
    let archive = dist.join(&name);
    let bytes =
        std::fs::read(&archive).with_context(|| format!("{}: run scripts/build-images.sh", archive.display()))?;
    let sha = {
        use sha2::Digest as _;
        format!("{:x}", sha2::Sha256::digest(&bytes))
    };
    let manifest = std::fs::read_to_string(dist.join("streamfleet.krew.yaml"))?;
    assert!(manifest.contains(&format!("sha256: {sha}")), "the manifest's checksum is the archive's:\n{manifest}");
    assert!(manifest.contains(&format!("/v{}/{name}", env!("CARGO_PKG_VERSION"))), "{manifest}");
    assert_eq!(std::fs::read_to_string(dist.join(format!("{name}.sha256")))?, format!("{sha}  {name}\n"));

    // What is in it: LICENSE and a binary that runs on any linux/amd64.
    let unpacked = tempfile::tempdir()?;
    let out = std::process::Command::new("tar").arg("-xzf").arg(&archive).arg("-C").arg(unpacked.path()).output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut files: Vec<String> =
        std::fs::read_dir(unpacked.path())?.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(files, ["LICENSE", "streamfleet"]);
    assert!(is_static_elf(&std::fs::read(unpacked.path().join("streamfleet"))?), "the CLI needs a dynamic loader");

    // Packed again from the same binary: the same bytes.
    let out = std::process::Command::new("bash").arg(repo_path("scripts/package-cli.sh")).output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&archive)?, bytes, "the archive is not reproducible");

    // The documented install, with kubectl's plugin discovery after it.
    let home = tempfile::tempdir()?;
    let bin = home.path().join("bin");
    std::fs::create_dir(&bin)?;
    std::os::unix::fs::symlink(tools::tool("krew")?, bin.join("kubectl-krew"))?;
    std::os::unix::fs::symlink(tools::tool("kubectl")?, bin.join("kubectl"))?;
    let krew_root = home.path().join("krew");
    let path = format!("{}:{}:/usr/bin:/bin", krew_root.join("bin").display(), bin.display());
    let kubectl = |args: &[&str]| {
        let out = std::process::Command::new(bin.join("kubectl"))
            .args(args)
            .current_dir(repo_path("."))
            .env_clear()
            .env("PATH", &path)
            .env("HOME", home.path())
            .env("KREW_ROOT", &krew_root)
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "kubectl {args:?}: {text}");
        text
    };
    let archive_arg = format!("--archive=target/dist/{name}");
    kubectl(&["krew", "install", "--manifest=target/dist/streamfleet.krew.yaml", &archive_arg]);
    assert!(kubectl(&["plugin", "list"]).contains("kubectl-streamfleet"));
    assert!(kubectl(&["streamfleet", "dlq", "--help"]).contains("Usage: kubectl-streamfleet dead-letters"));
    let crd: serde_json::Value = serde_json::from_str(&kubectl(&["streamfleet", "crd"]))?;
    assert_eq!(crd["metadata"]["name"], "streamconsumergroups.streamfleet.io");
    Ok(())
}
