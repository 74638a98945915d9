//! Hostile resources: whatever JSON reaches the operator as a
//! `StreamConsumerGroup` (an older API server's, a hand-edited status, a
//! buggy client's: wrong types, numbers past every integer type, huge
//! floats, unicode, missing and unknown fields), decoding returns the
//! resource or an error and never panics; and what decodes encodes to JSON
//! that decodes to the same resource (what the operator writes back is what
//! it read).

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use streamfleet_crd::{StreamConsumerGroup, StreamConsumerGroupSpec, StreamConsumerGroupStatus};

use streamfleet_crd::testing as hostile_json;

fn runner(cases: u32) -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(cases);
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
}

#[test]
fn the_valid_base_decodes() {
    let scg: StreamConsumerGroup = serde_json::from_value(hostile_json::base()).unwrap();
    assert_eq!(scg.spec.recovery.batch_size, 100);
    assert!(scg.status.is_some());
}

#[test]
fn any_document_decodes_or_is_refused_and_round_trips() {
    let decoded = AtomicUsize::new(0);
    let result = runner(1024).run(&hostile_json::document(), |doc: Value| {
        // Every type the operator decodes from the API server, alone too.
        let _ = serde_json::from_value::<StreamConsumerGroupSpec>(doc["spec"].clone());
        let _ = serde_json::from_value::<StreamConsumerGroupStatus>(doc["status"].clone());
        let _ = serde_json::from_str::<StreamConsumerGroup>(&doc.to_string());
        let Ok(scg) = serde_json::from_value::<StreamConsumerGroup>(doc) else { return Ok(()) };
        decoded.fetch_add(1, Ordering::Relaxed);
        let again: StreamConsumerGroup = serde_json::from_value(serde_json::to_value(&scg).unwrap())
            .map_err(|e| TestCaseError::fail(format!("what decoded does not decode once encoded: {e}")))?;
        prop_assert_eq!(&again.spec, &scg.spec);
        prop_assert_eq!(&again.status, &scg.status);
        prop_assert_eq!(&again.metadata, &scg.metadata);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let decoded = decoded.into_inner();
    eprintln!("{decoded} of the hostile documents decoded");
    assert!(decoded > 0, "no mutated resource decoded: the mutations are too coarse to test the round trip");
}
