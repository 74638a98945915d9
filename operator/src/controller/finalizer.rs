//! Deletion: the finalizer is present exactly while `deletionPolicy` is
//! `Delete`; on deletion the group is destroyed, then the resource may go.
//! Owned objects are removed by the garbage collector through owner references.

use super::Context;
use super::decide::PlannedEvent;
use crate::error::Error;
use crate::events::EventType;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt as _};
use serde_json::json;
use streamfleet_crd::{DeletionPolicy, StreamConsumerGroup};

/// Present while the group must be destroyed before the resource may go.
pub const FINALIZER: &str = "streamfleet.io/delete-group";

/// Keeps our finalizer present exactly while the policy is `Delete`.
pub async fn sync(scg: &StreamConsumerGroup, ctx: &Context) -> Result<(), Error> {
    let want = scg.spec.deletion_policy == DeletionPolicy::Delete;
    let has = scg.finalizers().iter().any(|f| f == FINALIZER);
    if want == has {
        return Ok(());
    }
    let mut finalizers: Vec<String> = scg.finalizers().iter().filter(|f| *f != FINALIZER).cloned().collect();
    if want {
        finalizers.push(FINALIZER.into());
    }
    set(scg, ctx, finalizers).await
}

async fn set(scg: &StreamConsumerGroup, ctx: &Context, finalizers: Vec<String>) -> Result<(), Error> {
    let api: Api<StreamConsumerGroup> = Api::namespaced(ctx.client.clone(), &scg.namespace().unwrap_or_default());
    // The resourceVersion makes this a compare-and-swap against concurrent edits.
    let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": scg.resource_version()}});
    api.patch(&scg.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    ctx.metrics.api_write("finalizer");
    Ok(())
}

/// The resource is being deleted: with `Delete`, destroy the group first.
pub async fn cleanup(scg: &StreamConsumerGroup, ctx: &Context) -> Result<Action, Error> {
    ctx.forget(scg);
    if !scg.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    if scg.spec.deletion_policy == DeletionPolicy::Delete {
        let destroyed = async {
            let (endpoint, mut conn) = super::observe::endpoint(ctx, scg).await?;
            // Another resource names this group on this Redis: it is theirs too.
            if let Some(other) = ctx.claimants(scg, &endpoint).first() {
                return Ok(Err(other.key.clone()));
            }
            let mut existed = false;
            // Every shard the spec names, valid or not (out of range: as many
            // as could have been made).
            let shards = u32::try_from(scg.spec.shards.unwrap_or(1)).unwrap_or(1).clamp(1, 64);
            for stream in streamfleet_streams::shard::shard_keys(&scg.spec.stream, shards) {
                existed |= streamfleet_streams::destroy_group(&mut conn, &stream, &scg.spec.group).await?;
            }
            Ok::<_, Error>(Ok(existed))
        }
        .await;
        match destroyed {
            Ok(Ok(existed)) => tracing::info!(existed, "consumer group destroyed"),
            Ok(Err(other)) => {
                let note = format!(
                    "deletionPolicy Delete: group {:?} on stream {:?} kept, {other} names it too",
                    scg.spec.group, scg.spec.stream
                );
                let event =
                    PlannedEvent { type_: EventType::Warning, reason: "GroupKept", action: "DestroyGroup", note };
                super::act::publish(ctx, scg, &event).await;
            }
            Err(e) => {
                let event = PlannedEvent {
                    type_: EventType::Warning,
                    reason: e.reason(),
                    action: "DestroyGroup",
                    note: e.to_string(),
                };
                super::act::publish(ctx, scg, &event).await;
                return Err(e);
            }
        }
    }
    let finalizers = scg.finalizers().iter().filter(|f| *f != FINALIZER).cloned().collect();
    set(scg, ctx, finalizers).await?;
    Ok(Action::await_change())
}
