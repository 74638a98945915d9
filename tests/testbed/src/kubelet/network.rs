//! Addresses: the node's, and one loopback address per pod.

/// The node's address. Each pod gets an address of its own in 127.0.0.0/8, so
/// pods that bind their pod IP (as the chart's operator does) never collide.
pub(super) const HOST_IP: &str = "127.0.0.1";

/// The `n`th pod's address: 127.A.B.C with C in 1..=254, never 127.0.0.1.
pub fn pod_ip(n: u32) -> String {
    let c = 1 + n % 254;
    let b = (n / 254) % 256;
    let a = 1 + (n / 254 / 256) % 254;
    format!("127.{a}.{b}.{c}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ips_are_distinct_loopback_addresses() {
        let ips: std::collections::BTreeSet<String> = (0..70_000).map(pod_ip).collect();
        assert_eq!(ips.len(), 70_000);
        for ip in &ips {
            let addr: std::net::Ipv4Addr = ip.parse().unwrap();
            assert!(addr.is_loopback() && addr != std::net::Ipv4Addr::LOCALHOST, "{ip}");
            assert!(!ip.ends_with(".0") && !ip.ends_with(".255"), "{ip}");
        }
    }
}
