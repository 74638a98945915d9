//! Which local binary runs an image: an explicit mapping, an image of the
//! local OCI store (run from its own unpacked filesystem, as its user), or
//! `streamfleet/NAME` → the workspace binary `NAME`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What runs for an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub binary: PathBuf,
    /// The image's `User` (uid, gid); `None`: the stand-in's own user.
    pub user: Option<(u32, u32)>,
}

/// Image (without tag) → local binary.
#[derive(Clone, Debug, Default)]
pub struct ImageMap {
    explicit: HashMap<String, PathBuf>,
    bin_dir: Option<PathBuf>,
    /// A folder of OCI image layouts (`scripts/build-images.sh` writes
    /// `target/images/<name>/`): an image whose full reference one of them
    /// is tagged with runs from that layout.
    store: Option<PathBuf>,
}

impl ImageMap {
    /// Maps `streamfleet/NAME` to `bin_dir/NAME`.
    pub fn with_bin_dir(bin_dir: PathBuf) -> Self {
        Self { explicit: HashMap::new(), bin_dir: Some(bin_dir), store: None }
    }

    /// Runs images found in the OCI layouts under `store` from their own filesystems.
    pub fn with_store(mut self, store: PathBuf) -> Self {
        self.store = Some(store);
        self
    }

    pub fn insert(&mut self, image: &str, binary: PathBuf) {
        self.explicit.insert(image_repository(image).to_string(), binary);
    }

    pub fn resolve(&self, image: &str) -> Option<Resolved> {
        let repo = image_repository(image);
        if let Some(path) = self.explicit.get(repo) {
            return Some(Resolved { binary: path.clone(), user: None });
        }
        if let Some(found) = self.store.as_deref().and_then(|store| from_store(store, image)) {
            return Some(found);
        }
        let name = repo.strip_prefix("streamfleet/")?;
        let path = self.bin_dir.as_ref()?.join(name);
        path.is_file().then_some(Resolved { binary: path, user: None })
    }
}

/// Finds `image` (its full reference) in the layouts under `store`, unpacks
/// it once into `<tmp>/streamfleet-images/rootfs-<digest>` (which the image's
/// user can reach, wherever the checkout is) and returns its entrypoint there.
fn from_store(store: &Path, image: &str) -> Option<Resolved> {
    use std::os::unix::fs::PermissionsExt as _;
    let unpacked = std::env::temp_dir().join("streamfleet-images");
    std::fs::create_dir_all(&unpacked).ok()?;
    std::fs::set_permissions(&unpacked, std::fs::Permissions::from_mode(0o755)).ok()?;
    for layout in std::fs::read_dir(store).ok()?.flatten().map(|e| e.path()) {
        let Ok(images) = streamfleet_images::read_layout(&layout) else {
            continue;
        };
        let Some(found) = images.into_iter().find(|i| i.reference == image) else {
            continue;
        };
        let hex = found.manifest_digest.trim_start_matches("sha256:");
        let rootfs = unpacked.join(format!("rootfs-{}", &hex[..hex.len().min(12)]));
        if !rootfs.exists() {
            // Unpacked aside, then renamed: two pods starting at once never
            // see half a filesystem.
            let tmp = unpacked.join(format!(".unpack-{}", rand::random::<u64>()));
            let made = streamfleet_images::unpack(&found, &tmp)
                .and_then(|()| Ok(std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?));
            if let Err(e) = made {
                tracing::warn!("unpacking {image}: {e:#}");
                return None;
            }
            if std::fs::rename(&tmp, &rootfs).is_err() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
        }
        let entrypoint = found.entrypoint();
        let binary = rootfs.join(entrypoint.first()?.trim_start_matches('/'));
        return Some(Resolved { binary, user: found.user() });
    }
    None
}

/// `registry/name:tag@digest` → `registry/name` (a `:` after the last `/` is a tag).
pub fn image_repository(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    match no_digest.rfind(':') {
        Some(colon) if !no_digest[colon..].contains('/') => &no_digest[..colon],
        _ => no_digest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_repository_strips_tag_and_digest_but_not_registry_port() {
        assert_eq!(image_repository("streamfleet/testproc:0.1"), "streamfleet/testproc");
        assert_eq!(image_repository("streamfleet/testproc"), "streamfleet/testproc");
        assert_eq!(image_repository("reg:5000/a/b"), "reg:5000/a/b");
        assert_eq!(image_repository("reg:5000/a/b:v1@sha256:abc"), "reg:5000/a/b");
    }
}
