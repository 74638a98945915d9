//! Every variable of the contract with what it means: `docs/env-contract.md`'s
//! table is generated from here ([`variables_table`]), so the docs name
//! exactly what the operator renders.

use crate::*;

/// One row of the table: one variable, or a pair set together.
#[derive(Clone, Copy, Debug)]
pub struct Variable {
    pub names: &'static [&'static str],
    /// Markdown.
    pub meaning: &'static str,
}

/// The variables the operator renders, in the docs' order.
pub const VARIABLES: &[Variable] = &[
    Variable {
        names: &[REDIS_URL],
        meaning: "the Redis URL: `spec.redis.url` (no credentials in it), or from the Secret key in `spec.redis.urlSecretRef` (then never copied into the pod spec)",
    },
    Variable { names: &[REDIS_USERNAME], meaning: "the ACL user, `spec.redis.username` (empty when unset)" },
    Variable {
        names: &[REDIS_PASSWORD],
        meaning: "the password as it is, byte for byte (not percent-encoded; a trailing newline is part of it), from the Secret key in `spec.redis.passwordSecretRef` (empty when unset; set, the URL carries none). Authenticate with `AUTH [username] password`",
    },
    Variable { names: &[REDIS_MODE], meaning: "`Standalone` or `Cluster`" },
    Variable {
        names: &[REDIS_CA_PEM],
        meaning: "PEM CA bundle for `rediss://`, from `spec.redis.tls.caSecretRef` (empty when unset)",
    },
    Variable {
        names: &[REDIS_CLIENT_CERT_PEM, REDIS_CLIENT_KEY_PEM],
        meaning: "PEM client certificate and key (`tls.crt`, `tls.key` of the `kubernetes.io/tls` Secret in `spec.redis.tls.clientCertSecretRef`; empty when unset), for a server with `tls-auth-clients yes`",
    },
    Variable { names: &[STREAMS], meaning: "comma-separated stream keys" },
    Variable { names: &[GROUP], meaning: "the consumer group" },
    Variable {
        names: &[POD_NAME, POD_UID],
        meaning: "the pod's name and UID (`fieldRef: metadata.name`, `metadata.uid`)",
    },
    Variable {
        names: &[CONSUMER],
        meaning: "this consumer's name: `$(STREAMFLEET_POD_NAME).$(STREAMFLEET_POD_UID)`. The UID makes it unforgeable: the operator releases a consumer's entries only when no pod has that very name and UID **and** the consumer has been silent in Redis for 2 s",
    },
    Variable {
        names: &[DRAIN_TIMEOUT_MS],
        meaning: "how long handlers in flight may run on after SIGTERM: the pod's `terminationGracePeriodSeconds` (default 30) less 3 s, and at least half of it",
    },
    Variable { names: &[MIN_IDLE_MS], meaning: "idle time after which an entry may be claimed" },
    Variable {
        names: &[MAX_DELIVERIES],
        meaning: "deliveries after which an entry is dead-lettered (`spec.recovery.maxDeliveries`, default 10)",
    },
    Variable {
        names: &[RETRY_BACKOFF],
        meaning: "`Exponential` or `Fixed`: how the delay between attempts grows (rule 10, [retries.md](retries.md))",
    },
    Variable {
        names: &[RETRY_INITIAL_DELAY_MS],
        meaning: "the delay after the first failure; absent: `STREAMFLEET_MIN_IDLE_MS`",
    },
    Variable {
        names: &[RETRY_MAX_DELAY_MS],
        meaning: "the longest delay (absent: 900000, or the first delay when longer); delays are capped at 7 days (604800000), the first never below min-idle-time",
    },
    Variable {
        names: &[RETRY_JITTER_PERCENT],
        meaning: "each delay lengthened by a random 0 to this many percent (default 20)",
    },
    Variable {
        names: &[RETRY_FOR_MS],
        meaning: "no attempt later than this after the first failure (only when `spec.recovery.retry.retryForSeconds` is set)",
    },
    Variable {
        names: &[DEAD_LETTER_STREAM],
        meaning: "where dead letters go; never one of `STREAMFLEET_STREAMS` (a worker must refuse to start on that: dead letters would be consumed again). Set only for a pipeline of one shard; with `spec.shards` > 1 it is absent and each shard's letters go to `{<shard>}:dead:<group>` (`<shard>:dead:<group>` when the shard has a hash tag; [sharding.md](sharding.md))",
    },
    Variable { names: &[BATCH_SIZE], meaning: "entries per read and per claim" },
    Variable {
        names: &[CONCURRENCY],
        meaning: "handlers in flight per process (only when `spec.worker.concurrency` is set; absent, the Rust library's default is 10); entries with the same business key never run at once, and each entry is acked as soon as its handler is done",
    },
    Variable { names: &[MODE], meaning: "`consume` (Deployment) or `recovery` (recovery Job in `Worker` mode)" },
];

/// The markdown table of [`VARIABLES`].
pub fn variables_table() -> String {
    let mut table = String::from("| variable | value |\n|---|---|\n");
    for v in VARIABLES {
        let names: Vec<String> = v.names.iter().map(|n| format!("`{n}`")).collect();
        table.push_str(&format!("| {} | {} |\n", names.join(", "), v.meaning));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/env-contract.md");
    const BEGIN: &str = "<!-- generated: streamfleet_contract::variables_table; write with STREAMFLEET_WRITE_DOCS=1 cargo test -p streamfleet-contract -->\n";
    const END: &str = "<!-- end of generated table -->";

    /// The docs' table is this crate's: regenerated on request, and a test
    /// fails while it differs.
    #[test]
    fn the_docs_table_is_the_generated_one() {
        let doc = std::fs::read_to_string(DOC).unwrap();
        let (head, rest) = doc.split_once(BEGIN).expect("docs/env-contract.md has the table's start marker");
        let (_, tail) = rest.split_once(END).expect("docs/env-contract.md has the table's end marker");
        let want = format!("{head}{BEGIN}{}{END}{tail}", variables_table());
        if std::env::var_os("STREAMFLEET_WRITE_DOCS").is_some() {
            std::fs::write(DOC, &want).unwrap();
        }
        assert!(
            doc == want,
            "docs/env-contract.md's table is not generated from VARIABLES: run STREAMFLEET_WRITE_DOCS=1 cargo test -p streamfleet-contract"
        );
    }
}
