//! OCI images without a container engine: a single-layer image of one static
//! binary (plus `/etc/passwd` naming the non-root user and the CA roots),
//! written as an OCI image layout that `crane push` or `skopeo copy` can
//! publish. Every byte is a function of the inputs (fixed timestamps,
//! owners and order, gzip without a name or time), so the same binary gives
//! the same digest. [`read_layout`] and [`unpack`] read an image back, as
//! the test bed's kubelet stand-in does to run a pod from it.

use anyhow::{Context as _, Result, bail};
use sha2::{Digest as _, Sha256};
use std::io::Read as _;
use std::path::{Path, PathBuf};

/// The user every image runs as: distroless's `nonroot`.
pub const USER: u32 = 65532;

/// What goes into an image.
pub struct ImageSpec<'a> {
    /// The static binary, installed as `/<name>` and run as the entrypoint.
    pub binary: &'a Path,
    pub name: &'a str,
    /// The image reference recorded in the layout (`org.opencontainers.image.ref.name`).
    pub reference: &'a str,
    /// `org.opencontainers.image.*` and other labels.
    pub labels: &'a [(String, String)],
    /// CA roots to install as `/etc/ssl/certs/ca-certificates.crt`, if any.
    pub ca_roots: Option<&'a Path>,
    /// Seconds since the epoch for every timestamp (`SOURCE_DATE_EPOCH`).
    pub epoch: u64,
}

/// A blob and its descriptor fields.
struct Blob {
    bytes: Vec<u8>,
    digest: String,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Self {
        let digest = sha256(&bytes);
        Self { bytes, digest }
    }
}

fn sha256(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The layer's uncompressed tar: `/<name>` (0755), `/etc/passwd`,
/// `/etc/group`, the CA roots, and `/tmp` (1777), owned by root, in a fixed order.
pub fn layer_tar(spec: &ImageSpec) -> Result<Vec<u8>> {
    let binary = std::fs::read(spec.binary).with_context(|| format!("reading {}", spec.binary.display()))?;
    let passwd =
        format!("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{USER}:{USER}:nonroot:/home/nonroot:/sbin/nologin\n");
    let group = format!("root:x:0:\nnonroot:x:{USER}:\n");
    let mut builder = tar::Builder::new(Vec::new());
    let dir = |path: &str, mode: u32, builder: &mut tar::Builder<Vec<u8>>| -> Result<()> {
        let mut h = header(spec.epoch, mode, 0);
        h.set_entry_type(tar::EntryType::Directory);
        h.set_cksum();
        builder.append_data(&mut h, path, std::io::empty())?;
        Ok(())
    };
    dir("etc/", 0o755, &mut builder)?;
    for (path, bytes) in [("etc/group", group.as_bytes()), ("etc/passwd", passwd.as_bytes())] {
        let mut h = header(spec.epoch, 0o644, bytes.len() as u64);
        builder.append_data(&mut h, path, bytes)?;
    }
    if let Some(ca) = spec.ca_roots {
        let roots = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
        dir("etc/ssl/", 0o755, &mut builder)?;
        dir("etc/ssl/certs/", 0o755, &mut builder)?;
        let mut h = header(spec.epoch, 0o644, roots.len() as u64);
        builder.append_data(&mut h, "etc/ssl/certs/ca-certificates.crt", roots.as_slice())?;
    }
    dir("home/", 0o755, &mut builder)?;
    let mut h = header(spec.epoch, 0o755, 0);
    h.set_entry_type(tar::EntryType::Directory);
    h.set_uid(u64::from(USER));
    h.set_gid(u64::from(USER));
    h.set_cksum();
    builder.append_data(&mut h, "home/nonroot/", std::io::empty())?;
    dir("tmp/", 0o1777, &mut builder)?;
    let mut h = header(spec.epoch, 0o755, binary.len() as u64);
    builder.append_data(&mut h, spec.name, binary.as_slice())?;
    Ok(builder.into_inner()?)
}

fn header(epoch: u64, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(epoch);
    h.set_uid(0);
    h.set_gid(0);
    h.set_entry_type(tar::EntryType::Regular);
    h
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write as _;
    // No file name, mtime 0: the same input always compresses to the same bytes.
    let mut gz = flate2::GzBuilder::new().mtime(0).write(Vec::new(), flate2::Compression::best());
    gz.write_all(bytes)?;
    Ok(gz.finish()?)
}

/// RFC 3339 of `epoch` seconds (UTC), without a date library.
fn rfc3339(epoch: u64) -> String {
    let (days, secs) = (epoch / 86_400, epoch % 86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The image's config and manifest digests once written.
pub struct Written {
    pub manifest_digest: String,
    pub config_digest: String,
}

/// Writes the image as an OCI image layout in `out` (replacing what was there).
pub fn write_layout(spec: &ImageSpec, out: &Path) -> Result<Written> {
    let tar = layer_tar(spec)?;
    let diff_id = sha256(&tar);
    let layer = Blob::new(gzip(&tar)?);
    let created = rfc3339(spec.epoch);
    let labels: serde_json::Map<String, serde_json::Value> =
        spec.labels.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "User": format!("{USER}:{USER}"),
            "Entrypoint": [format!("/{}", spec.name)],
            "Env": ["PATH=/", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"],
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": created, "created_by": format!("streamfleet build-image: /{}", spec.name)}],
    });
    let config = Blob::new(serde_json::to_vec(&config)?);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config.digest, "size": config.bytes.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer.digest, "size": layer.bytes.len()}],
        "annotations": labels,
    });
    let manifest = Blob::new(serde_json::to_vec(&manifest)?);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest.digest,
            "size": manifest.bytes.len(),
            "annotations": {"org.opencontainers.image.ref.name": spec.reference},
        }],
    });
    if out.exists() {
        std::fs::remove_dir_all(out)?;
    }
    let blobs = out.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    for blob in [&layer, &config, &manifest] {
        std::fs::write(blobs.join(blob.digest.trim_start_matches("sha256:")), &blob.bytes)?;
    }
    std::fs::write(out.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    std::fs::write(out.join("index.json"), serde_json::to_vec(&index)?)?;
    Ok(Written { manifest_digest: manifest.digest, config_digest: config.digest })
}

/// An image read back from a layout.
#[derive(Debug)]
pub struct Image {
    pub reference: String,
    pub manifest_digest: String,
    /// The image config's `config` object (Entrypoint, User, Labels, ...).
    pub config: serde_json::Value,
    /// The compressed layers, in order.
    pub layers: Vec<PathBuf>,
}

impl Image {
    pub fn entrypoint(&self) -> Vec<String> {
        self.config["Entrypoint"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(String::from))
            .collect()
    }

    /// The `User` as uid and gid (`uid[:gid]`, numeric only).
    pub fn user(&self) -> Option<(u32, u32)> {
        let user = self.config["User"].as_str()?;
        let (uid, gid) = user.split_once(':').unwrap_or((user, user));
        Some((uid.parse().ok()?, gid.parse().ok()?))
    }
}

fn blob_path(layout: &Path, digest: &str) -> Result<PathBuf> {
    let hex = digest.strip_prefix("sha256:").with_context(|| format!("unsupported digest {digest}"))?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("malformed digest {digest}");
    }
    Ok(layout.join("blobs/sha256").join(hex))
}

/// Reads a blob, checking it against its digest.
fn read_blob(layout: &Path, digest: &str) -> Result<Vec<u8>> {
    let bytes = std::fs::read(blob_path(layout, digest)?)?;
    if sha256(&bytes) != digest {
        bail!("blob {digest} does not match its digest");
    }
    Ok(bytes)
}

/// Every image of an OCI layout, with the reference it is tagged with.
pub fn read_layout(layout: &Path) -> Result<Vec<Image>> {
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
    let mut images = Vec::new();
    for m in index["manifests"].as_array().into_iter().flatten() {
        let digest = m["digest"].as_str().context("manifest without a digest")?;
        let reference = m["annotations"]["org.opencontainers.image.ref.name"].as_str().unwrap_or_default();
        let manifest: serde_json::Value = serde_json::from_slice(&read_blob(layout, digest)?)?;
        let config_digest = manifest["config"]["digest"].as_str().context("manifest without a config")?;
        let config: serde_json::Value = serde_json::from_slice(&read_blob(layout, config_digest)?)?;
        let layers = manifest["layers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| blob_path(layout, l["digest"].as_str().unwrap_or_default()))
            .collect::<Result<_>>()?;
        images.push(Image {
            reference: reference.to_string(),
            manifest_digest: digest.to_string(),
            config: config["config"].clone(),
            layers,
        });
    }
    Ok(images)
}

/// Extracts an image's layers into `rootfs`, in order.
pub fn unpack(image: &Image, rootfs: &Path) -> Result<()> {
    std::fs::create_dir_all(rootfs)?;
    for layer in &image.layers {
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(std::fs::File::open(layer)?));
        archive.set_preserve_permissions(true);
        archive.set_preserve_ownerships(true);
        archive.unpack(rootfs)?;
    }
    Ok(())
}

/// The paths in an image's layers (for checks such as "no shell").
pub fn list_paths(image: &Image) -> Result<Vec<String>> {
    let mut paths = Vec::new();
    for layer in &image.layers {
        let mut bytes = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(layer)?).read_to_end(&mut bytes)?;
        let mut archive = tar::Archive::new(bytes.as_slice());
        for entry in archive.entries()? {
            paths.push(entry?.path()?.display().to_string());
        }
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_764_547_200), "2025-12-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400 + 3661), "2000-02-29T01:01:01Z");
    }

    #[test]
    fn the_same_inputs_give_the_same_digest_and_the_image_reads_back() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let binary = dir.path().join("app");
        std::fs::write(&binary, b"\x7fELF not really")?;
        let labels = vec![("org.opencontainers.image.title".to_string(), "app".to_string())];
        let spec = ImageSpec {
            binary: &binary,
            name: "app",
            reference: "example.org/app:1",
            labels: &labels,
            ca_roots: None,
            epoch: 1_764_547_200,
        };
        let a = write_layout(&spec, &dir.path().join("a"))?;
        let b = write_layout(&spec, &dir.path().join("b"))?;
        assert_eq!(a.manifest_digest, b.manifest_digest);
        let images = read_layout(&dir.path().join("a"))?;
        assert_eq!(images.len(), 1);
        let image = &images[0];
        assert_eq!(image.reference, "example.org/app:1");
        assert_eq!(image.manifest_digest, a.manifest_digest);
        assert_eq!(image.entrypoint(), ["/app"]);
        assert_eq!(image.user(), Some((USER, USER)));
        assert_eq!(image.config["Labels"]["org.opencontainers.image.title"], "app");
        let paths = list_paths(image)?;
        assert!(paths.contains(&"app".to_string()) && paths.contains(&"etc/passwd".to_string()), "{paths:?}");
        assert!(!paths.iter().any(|p| p.starts_with("bin")), "{paths:?}");
        let rootfs = dir.path().join("rootfs");
        unpack(image, &rootfs)?;
        assert_eq!(std::fs::read(rootfs.join("app"))?, b"\x7fELF not really");
        // A different binary is a different image.
        std::fs::write(&binary, b"\x7fELF other")?;
        let c = write_layout(&spec, &dir.path().join("c"))?;
        assert_ne!(c.manifest_digest, a.manifest_digest);
        Ok(())
    }
}
