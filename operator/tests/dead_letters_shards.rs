//! A sharded pipeline's dead letters (one stream per shard) on a real
//! redis-server: the same ID in two shards' streams names two letters, so a
//! bare ID is refused and `<stream>@<ID>` takes exactly the one meant.
//! Before `stream@id`, `purge --ids 5-0` deleted the letter from both.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use streamfleet_operator::console::letters::{Action, Letters, Refusal};
use streamfleet_operator::console::wire::ActionRequest;
use streamfleet_streams::deadletter as dl;
use streamfleet_streams::keys::dead_letter_stream;
use streamfleet_testbed::RedisServer;

const ID: &str = "5-0";

async fn letters(server: &RedisServer, streams: &[String]) -> Result<Letters> {
    let endpoint = streamfleet_streams::Endpoint::new(server.url(), streamfleet_streams::Mode::Standalone);
    let conn = streamfleet_streams::StreamConnection::connect(&endpoint).await?;
    Ok(Letters { conn, streams: streams.to_vec() })
}

fn ids(named: &[&str]) -> ActionRequest {
    ActionRequest { ids: named.iter().map(|s| s.to_string()).collect(), ..ActionRequest::default() }
}

#[tokio::test]
async fn a_letter_of_a_sharded_pipeline_is_named_by_its_stream_and_only_that_one_is_taken() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let shards = ["orders".to_string(), "orders:1".to_string()];
    let streams: Vec<String> = shards.iter().map(|s| dead_letter_stream(s, "billing")).collect();
    // One letter with the same ID on each shard's stream (IDs are per stream).
    for (shard, stream) in shards.iter().zip(&streams) {
        let letter = [(dl::F_SOURCE_STREAM, shard.as_str()), (dl::F_GROUP, "billing"), (dl::F_REASON, "permanent")];
        let _: String = redis::cmd("XADD").arg(stream).arg(ID).arg(&letter[..]).query_async(&mut conn).await?;
    }
    let mut sharded = letters(&server, &streams).await?;

    // Listed under names that tell them apart.
    let list = sharded.list(&Default::default(), None, 10, 100).await?;
    let refs: Vec<&str> = list.items.iter().map(|l| l.reference.as_str()).collect();
    assert_eq!(refs, vec![format!("{}@{ID}", streams[0]), format!("{}@{ID}", streams[1])]);

    // A bare ID is refused, naming the form to use; nothing is taken.
    let refused = sharded.show(ID, false).await.unwrap_err();
    assert!(matches!(refused.downcast_ref::<Refusal>(), Some(Refusal::AmbiguousId { .. })), "{refused:#}");
    assert!(refused.to_string().contains("<dead-letter stream>@<ID>"), "{refused}");
    let refused = sharded.act(Action::Purge, &ids(&[ID])).await.unwrap_err();
    assert!(matches!(refused.error.downcast_ref::<Refusal>(), Some(Refusal::AmbiguousId { .. })));
    let unknown = sharded.act(Action::Purge, &ids(&["{elsewhere}:dead@5-0"])).await.unwrap_err();
    assert!(unknown.error.to_string().contains("not one of this pipeline's"), "{:#}", unknown.error);
    for stream in &streams {
        let n: usize = redis::cmd("XLEN").arg(stream).query_async(&mut conn).await?;
        assert_eq!(n, 1, "{stream}: refused, so untouched");
    }

    // Named by its stream: shown, and purged alone.
    let second = format!("{}@{ID}", streams[1]);
    let shown = sharded.show(&second, false).await?.expect("the second shard's letter");
    assert_eq!(
        (shown.dead_letter_stream.as_str(), shown.source_stream.as_deref()),
        (streams[1].as_str(), Some("orders:1"))
    );
    let purged = sharded.act(Action::Purge, &ids(&[&second])).await.map_err(|i| i.error)?;
    assert_eq!((purged.matched, purged.done), (1, 1));
    let first: usize = redis::cmd("XLEN").arg(&streams[0]).query_async(&mut conn).await?;
    let second: usize = redis::cmd("XLEN").arg(&streams[1]).query_async(&mut conn).await?;
    assert_eq!((first, second), (1, 0), "only the letter named was purged");

    // One dead-letter stream: the bare ID is enough, and listed as such.
    let mut single = letters(&server, &streams[..1]).await?;
    let list = single.list(&Default::default(), None, 10, 100).await?;
    assert_eq!(list.items.iter().map(|l| l.reference.as_str()).collect::<Vec<_>>(), vec![ID]);
    assert!(single.show(ID, false).await?.is_some());
    Ok(())
}
