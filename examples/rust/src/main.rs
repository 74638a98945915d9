//! The example order worker used by the demo and the tests.
//!
//! Each entry is an order (`order_id`, `amount_cents`). Handling it charges
//! the order in a ledger (a Redis hash standing in for a payment provider)
//! with the order ID as the idempotency key: `HSETNX {ledger}:charges <order>`.
//! A repeated charge is refused by the ledger and counted in
//! `{ledger}:duplicates`, so "every order charged exactly once" can be checked;
//! `{ledger}:charged-by` names who charged each order first, so a drill can
//! tell a repeat caused by a death between charge and ack (expected) from
//! one that got through the guard while the first holder lived (a leak).
//! The guard's fencing token goes with each charge (`{ledger}:fences`): a
//! holder older than one already seen for the order is refused.
//! A refusal of the first charger's own retry (its charge happened, the reply
//! was lost, e.g. to a Redis crash) is also counted per order in `{ledger}:own-retries`;
//! the first refused charge by anyone else is timed in `{ledger}:repeated-at`,
//! so a drill can check that the first charger had died by then.
//! Injected faults are counted in `{ledger}:faults` (`transient`, `crash`) and
//! charges per consumer in `{ledger}:by-consumer`, so a drill can prove that
//! what it injected happened.
//!
//! Knobs for drills (all optional):
//! * `EXAMPLE_LEDGER_URL`: the ledger's Redis (default: the pipeline's);
//! * `EXAMPLE_TRANSIENT_PERCENT`: chance of a simulated gateway timeout;
//! * `EXAMPLE_CRASH_PERCENT`: chance of aborting after the charge, before the ack;
//! * `EXAMPLE_STALL_PERCENT`, `EXAMPLE_STALL_MS`: chance of stalling that
//!   long after the charge, before the ack, announced first in the list
//!   `{ledger}:stalls` as `<pid> <consumer> <entry ID> <order> <stream>`, so a drill
//!   can aim a SIGKILL between the effect and the ack;
//! * `EXAMPLE_HANDLER_MS`: time each charge takes;
//! * `EXAMPLE_GUARD=off`: no idempotency guard (the ledger's own idempotency alone);
//! * the key `{ledger}:down`, while it exists: the payment provider is
//!   down and fails every charge transiently (an outage a test switches on
//!   and off), counting each attempt.
//!
//! Entries with `poison=1` are refused (permanent failure → dead letter);
//! entries without a numeric `amount_cents` are malformed. An entry with
//! `crash=1` kills the process whenever its handler starts, before any
//! charge (a payload that runs the worker out of memory, say): each death
//! is timed first in the list `{ledger}:aborts` as `<consumer> <Unix ms>`
//! (after the process's charges in flight, on Redis's clock),
//! so a drill can show that the entry ends a `crashed-worker` dead letter
//! alone after the crash limit, and excuse its batch-mates' repeats only
//! after a death it can time.

use rand::Rng as _;
use std::time::Duration;
use streamfleet_streams::{Endpoint, StreamConnection};
use streamfleet_worker::{Entry, Handler, Outcome, Worker, WorkerConfig};

/// The payment provider's side of a charge, in one script: refuses a holder
/// whose fencing token is older than one already seen for the order (a
/// stale holder), charges once per order (`HSETNX`), and keeps the books a
/// drill reads: who charged each order first, charges per consumer, and
/// every refused second charge (and which were the first charger's own).
/// KEYS: charges, charged-by, by-consumer, duplicates, fences, faults,
/// own-retries, charged-at (Unix ms of the first charge), repeated-at (Unix
/// ms of the first refused charge by a consumer other than the first
/// charger), outage switch (while it exists the provider answers "503" to
/// every call, each counted in `faults` as `down`, with the second
/// (`down-at:<s>`) it came in). ARGV: order, amount, consumer, fence (0:
/// none). Returns 1 charged, 0 already charged, -1 stale fence, -2 down.
static CHARGE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        if redis.call('EXISTS', KEYS[10]) == 1 then
            local now = redis.call('TIME')
            redis.call('HINCRBY', KEYS[6], 'down', 1)
            redis.call('HINCRBY', KEYS[6], 'down-at:' .. now[1], 1)
            return -2
        end
        local fence = tonumber(ARGV[4])
        if fence > 0 then
            local seen = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
            if fence < seen then
                redis.call('HINCRBY', KEYS[6], 'stale-fence', 1)
                return -1
            end
            redis.call('HSET', KEYS[5], ARGV[1], fence)
        end
        if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
            local now = redis.call('TIME')
            redis.call('HSET', KEYS[8], ARGV[1], now[1] * 1000 + math.floor(now[2] / 1000))
            redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
            redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
            return 1
        end
        redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
        if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[3] then
            redis.call('HINCRBY', KEYS[7], ARGV[1], 1)
        else
            local now = redis.call('TIME')
            redis.call('HSETNX', KEYS[9], ARGV[1], now[1] * 1000 + math.floor(now[2] / 1000))
        end
        return 0",
    )
});

struct Orders {
    ledger: StreamConnection,
    consumer: String,
    transient_percent: f64,
    crash_percent: f64,
    stall_percent: f64,
    stall_time: Duration,
    handler_time: Duration,
}

/// Charges in flight (read) against a death (write): a process that kills
/// itself waits for its charges in flight, and starts no new one.
static CHARGING: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A death, timed by Redis's clock as the charges are: KEYS: the deaths
/// list; ARGV: the consumer.
static DEATH: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        local now = redis.call('TIME')
        return redis.call('RPUSH', KEYS[1], ARGV[1] .. ' ' .. (now[1] * 1000 + math.floor(now[2] / 1000)))",
    )
});

fn percent(name: &str) -> f64 {
    std::env::var(name).ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0).clamp(0.0, 100.0)
}

impl Orders {
    /// Bookkeeping for drills; a failure to count is only logged.
    async fn count(&self, ledger: &mut StreamConnection, hash: &str, field: &str) {
        let counted: redis::RedisResult<i64> =
            redis::cmd("HINCRBY").arg(hash).arg(field).arg(1).query_async(ledger).await;
        if let Err(e) = counted {
            tracing::warn!("counting {hash} {field}: {e}");
        }
    }
}

impl Handler for Orders {
    fn business_key(&self, entry: &Entry) -> Option<String> {
        entry.field_str("order_id").map(str::to_string)
    }

    async fn handle(&self, entry: &Entry) -> Outcome {
        if streamfleet_worker::current_delivery().is_some_and(|d| d.deliveries > 1) {
            self.count(&mut self.ledger.clone(), "{ledger}:faults", "redelivered").await;
        }
        let Some(order) = entry.field_str("order_id") else {
            return Outcome::Malformed("no order_id field".into());
        };
        let Some(amount) = entry.field_str("amount_cents").and_then(|a| a.parse::<u64>().ok()) else {
            return Outcome::Malformed(format!("order {order}: amount_cents missing or not a number"));
        };
        if entry.field_str("poison") == Some("1") {
            return Outcome::Permanent(format!("order {order}: card declined"));
        }
        if entry.field_str("crash") == Some("1") {
            tracing::error!(order, "an order that kills the worker: aborting");
            // No charge of this process is in flight from here on, so every
            // charge it made is timed (by the same Redis clock) before its death.
            let _dying = CHARGING.write().await;
            let _: redis::RedisResult<i64> =
                DEATH.key("{ledger}:aborts").arg(&self.consumer).invoke_async(&mut self.ledger.clone()).await;
            std::process::abort();
        }
        if !self.handler_time.is_zero() {
            tokio::time::sleep(self.handler_time).await;
        }
        let mut ledger = self.ledger.clone();
        if rand::rng().random_range(0.0..100.0) < self.transient_percent {
            self.count(&mut ledger, "{ledger}:faults", "transient").await;
            return Outcome::Transient("payment gateway timeout".into());
        }
        // The guard's fencing token goes downstream with the charge.
        let fence = streamfleet_worker::current_delivery().and_then(|d| d.fence).unwrap_or(0);
        let charging = CHARGING.read().await;
        let charged: redis::RedisResult<i64> = CHARGE
            .key("{ledger}:charges")
            .key("{ledger}:charged-by")
            .key("{ledger}:by-consumer")
            .key("{ledger}:duplicates")
            .key("{ledger}:fences")
            .key("{ledger}:faults")
            .key("{ledger}:own-retries")
            .key("{ledger}:charged-at")
            .key("{ledger}:repeated-at")
            .key("{ledger}:down")
            .arg(order)
            .arg(amount)
            .arg(&self.consumer)
            .arg(fence)
            .invoke_async(&mut ledger)
            .await;
        drop(charging);
        match charged {
            // Charged now, or refused as a second charge (the effect already
            // happened, so this delivery is done too).
            Ok(1 | 0) => {}
            Ok(-2) => return Outcome::Transient("payment provider: 503 service unavailable".into()),
            // A newer holder has the order: leave it to them (never completed
            // here, or their own failure would be suppressed).
            Ok(_) => return Outcome::Transient(format!("order {order}: a newer holder has it (stale fence {fence})")),
            Err(e) => return Outcome::Transient(format!("ledger: {e}")),
        }
        if self.stall_percent > 0.0 && rand::rng().random_range(0.0..100.0) < self.stall_percent {
            let stall = format!("{} {} {} {order} {}", std::process::id(), self.consumer, entry.id, entry.stream);
            let _: redis::RedisResult<i64> =
                redis::cmd("RPUSH").arg("{ledger}:stalls").arg(stall).query_async(&mut ledger).await;
            tokio::time::sleep(self.stall_time).await;
        }
        if rand::rng().random_range(0.0..100.0) < self.crash_percent {
            // The worst moment to die: charged, not yet acked.
            tracing::error!(order, "simulated crash after the charge, before the ack");
            self.count(&mut ledger, "{ledger}:faults", "crash").await;
            let _: redis::RedisResult<i64> =
                redis::cmd("SADD").arg("{ledger}:crashed-consumers").arg(&self.consumer).query_async(&mut ledger).await;
            std::process::abort();
        }
        Outcome::Done
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let config = match WorkerConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("configuration: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let ledger_endpoint = match std::env::var("EXAMPLE_LEDGER_URL") {
        // The ledger's own URL, credentials included: none of the stream's.
        Ok(url) => Endpoint { url, username: None, password: None, ..config.endpoint.clone() },
        Err(_) => config.endpoint.clone(),
    };
    let ledger = match StreamConnection::connect(&ledger_endpoint).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("ledger: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let handler = Orders {
        ledger,
        consumer: config.consumer.clone(),
        transient_percent: percent("EXAMPLE_TRANSIENT_PERCENT"),
        crash_percent: percent("EXAMPLE_CRASH_PERCENT"),
        stall_percent: percent("EXAMPLE_STALL_PERCENT"),
        stall_time: Duration::from_millis(
            std::env::var("EXAMPLE_STALL_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000),
        ),
        handler_time: Duration::from_millis(
            std::env::var("EXAMPLE_HANDLER_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
        ),
    };
    let ttl = config.min_idle * u32::try_from(config.max_deliveries + 1).unwrap_or(u32::MAX) * 2;
    let mut worker = Worker::new(config, handler);
    // Off only to show the ledger's own idempotency holding alone (drills).
    if std::env::var("EXAMPLE_GUARD").as_deref() != Ok("off") {
        worker = worker.with_idempotency_guard(ttl.max(Duration::from_secs(3600)));
    }
    let stats = worker.stats();
    // /metrics, /healthz and /readyz: the library serves them when the pod
    // template sets STREAMFLEET_METRICS_ADDR.
    let result = worker.run(streamfleet_worker::shutdown_signal()).await;
    tracing::info!(?stats, "exiting");
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            std::process::ExitCode::from(1)
        }
    }
}
