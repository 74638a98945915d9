//! Addresses: the node's, and one loopback address per pod and per Service.
//! Test beds may run at once (the test command runs test binaries in
//! parallel): each claims a [`Slot`], a range of loopback addresses of its
//! own, so that one bed's pods and Services never take another's addresses.

use anyhow::{Result, bail};
use std::path::Path;

/// The node's address. Each pod gets an address of its own in 127.0.0.0/8, so
/// pods that bind their pod IP (as the chart's operator does) never collide.
pub(super) const HOST_IP: &str = "127.0.0.1";

/// How many test beds may run at once on one machine.
pub const SLOTS: u8 = 60;

/// Where the slots are claimed: one place per machine (not `$TMPDIR`, which
/// differs between shells), as the addresses are the machine's.
pub const SLOTS_DIR: &str = "/tmp/streamfleet-testbed-slots";

/// One test bed's addresses: its pods in 127.(1 + slot).0.0/16, its
/// Services in 127.(128 + slot).0.0/16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot(u8);

impl Slot {
    /// Claims a slot no live process holds: an exclusive lock on the file
    /// `slot-<n>` in `dir`, held as long as this process lives (the kernel
    /// drops it when the process dies, however it dies).
    pub fn claim(dir: &Path) -> Result<Slot> {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::create_dir_all(dir)?;
        // Every user's test beds share the machine's addresses, so the slots.
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
        for n in 0..SLOTS {
            let path = dir.join(format!("slot-{n}"));
            let file = match std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path) {
                Ok(file) => {
                    let _ = file.set_permissions(std::fs::Permissions::from_mode(0o666));
                    file
                }
                // Another user's slot file: a lock needs no write access.
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => std::fs::File::open(&path)?,
                Err(e) => return Err(e.into()),
            };
            match file.try_lock() {
                Ok(()) => {
                    // Held until the process ends.
                    std::mem::forget(file);
                    return Ok(Slot(n));
                }
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => return Err(e.into()),
            }
        }
        bail!("all {SLOTS} test-bed address slots in {} are held by live processes", dir.display())
    }

    /// The `n`th pod's address: 127.(1 + slot).B.C with C in 1..=254.
    pub fn pod_ip(self, n: u32) -> String {
        let c = 1 + n % 254;
        let b = (n / 254) % 256;
        format!("127.{}.{b}.{c}", 1 + self.0)
    }

    /// The range the API server hands Service IPs out from.
    pub fn service_range(self) -> String {
        format!("127.{}.0.0/16", 128 + self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ips_are_distinct_loopback_addresses_of_their_slot_only() {
        let mut all = std::collections::BTreeSet::new();
        for slot in [Slot(0), Slot(SLOTS - 1)] {
            let ips: std::collections::BTreeSet<String> = (0..65_024).map(|n| slot.pod_ip(n)).collect();
            assert_eq!(ips.len(), 65_024);
            for ip in &ips {
                let addr: std::net::Ipv4Addr = ip.parse().unwrap();
                assert!(addr.is_loopback() && addr != std::net::Ipv4Addr::LOCALHOST, "{ip}");
                assert!(!ip.ends_with(".0") && !ip.ends_with(".255"), "{ip}");
                // Services take 127.128.0.0 and up.
                assert!(addr.octets()[1] < 128, "{ip}");
            }
            all.extend(ips);
            let services = slot.service_range();
            let second: u8 = services.split('.').nth(1).unwrap().parse().unwrap();
            assert!(second >= 128 && services.ends_with(".0.0/16"), "{services}");
        }
        assert_eq!(all.len(), 2 * 65_024, "two slots share no address");
    }

    #[test]
    fn beds_running_at_once_claim_distinct_slots_and_a_dead_ones_slot_is_reused() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (Slot::claim(dir.path()).unwrap(), Slot::claim(dir.path()).unwrap());
        assert_ne!(a, b, "a slot stays held while its process lives");
        // Another process's claim, then its death.
        // (`--no-fork`: the process killed below is the one holding it.)
        let other = std::process::Command::new("flock")
            .arg("--no-fork")
            .arg(dir.path().join("slot-2"))
            .args(["sleep", "30"])
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut other = other;
        let c = Slot::claim(dir.path()).unwrap();
        assert_eq!(c, Slot(3), "slot 2 is the other process's");
        other.kill().unwrap();
        other.wait().unwrap();
        assert_eq!(Slot::claim(dir.path()).unwrap(), Slot(2), "its slot is free once it is gone");
    }
}
