//! Which local binary runs an image.

use std::collections::HashMap;
use std::path::PathBuf;

/// Image (without tag) → local binary.
#[derive(Clone, Debug, Default)]
pub struct ImageMap {
    explicit: HashMap<String, PathBuf>,
    bin_dir: Option<PathBuf>,
}

impl ImageMap {
    /// Maps `streamfleet/NAME` to `bin_dir/NAME`.
    pub fn with_bin_dir(bin_dir: PathBuf) -> Self {
        Self { explicit: HashMap::new(), bin_dir: Some(bin_dir) }
    }

    pub fn insert(&mut self, image: &str, binary: PathBuf) {
        self.explicit.insert(image_repository(image).to_string(), binary);
    }

    pub fn resolve(&self, image: &str) -> Option<PathBuf> {
        let repo = image_repository(image);
        if let Some(path) = self.explicit.get(repo) {
            return Some(path.clone());
        }
        let name = repo.strip_prefix("streamfleet/")?;
        let path = self.bin_dir.as_ref()?.join(name);
        path.is_file().then_some(path)
    }
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
