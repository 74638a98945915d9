//! What the watch caches keep of each object: only what a reconcile reads.
//! A fleet of thousands of resources holds two owned objects per resource;
//! their managed fields, annotations, pod templates and status conditions
//! are most of an object's size and nothing here reads them.
//!
//! Read from the caches: the resource's metadata, spec and status; of an
//! owned object its identity (name, namespace, uid, generation, owner
//! references: what maps it to its resource); a Deployment's `spec.replicas`
//! and `status.availableReplicas`; a pod's labels (which resource it works
//! for); a recovery Job's creation time and how it finished.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStatus};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::DeserializeGuard;
use streamfleet_crd::StreamConsumerGroup;

fn metadata(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    meta.annotations = None;
}

/// An owned object's identity only: labels and annotations go too.
fn identity(meta: &mut ObjectMeta) {
    metadata(meta);
    meta.labels = None;
}

pub fn deployment(d: &mut Deployment) {
    identity(&mut d.metadata);
    d.spec = d.spec.take().map(|spec| DeploymentSpec { replicas: spec.replicas, ..Default::default() });
    d.status = d
        .status
        .take()
        .map(|status| DeploymentStatus { available_replicas: status.available_replicas, ..Default::default() });
}

pub fn cronjob(c: &mut CronJob) {
    identity(&mut c.metadata);
    c.spec = None;
    c.status = None;
}

/// A recovery Job: its identity, when it was created, and how it finished.
pub fn job(j: &mut Job) {
    metadata(&mut j.metadata);
    j.metadata.owner_references = None;
    j.spec = None;
    if let Some(status) = j.status.as_mut() {
        *status = k8s_openapi::api::batch::v1::JobStatus {
            conditions: status
                .conditions
                .take()
                .map(|c| c.into_iter().filter(|c| c.type_ == "Complete" || c.type_ == "Failed").collect()),
            completion_time: status.completion_time.take(),
            ..Default::default()
        };
    }
}

pub fn pod(p: &mut Pod) {
    metadata(&mut p.metadata);
    p.spec = None;
    p.status = None;
}

/// The resource itself keeps its annotations (the payload-loss
/// acknowledgement is one).
pub fn resource(r: &mut DeserializeGuard<StreamConsumerGroup>) {
    if let Ok(scg) = r.0.as_mut() {
        scg.metadata.managed_fields = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_objects_keep_their_identity_replicas_and_available_replicas_only() {
        let mut d: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "w", "uid": "u", "generation": 3, "labels": {"a": "b"},
                         "annotations": {"deployment.kubernetes.io/revision": "1"},
                         "managedFields": [{"manager": "streamfleet"}],
                         "ownerReferences": [{"apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup", "name": "p", "uid": "o"}]},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"a": "b"}}, "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}},
            "status": {"availableReplicas": 1, "replicas": 1, "conditions": [{"type": "Available", "status": "True"}]}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        deployment(&mut d);
        assert_eq!((d.metadata.uid.as_deref(), d.metadata.generation), (Some("u"), Some(3)));
        assert_eq!(d.metadata.owner_references.as_ref().map(Vec::len), Some(1));
        assert!(d.metadata.labels.is_none() && d.metadata.managed_fields.is_none() && d.metadata.annotations.is_none());
        assert_eq!(d.spec.as_ref().and_then(|s| s.replicas), Some(2));
        assert!(d.spec.as_ref().is_some_and(|s| s.template.spec.is_none() && s.selector.match_labels.is_none()));
        assert_eq!(d.status.as_ref().and_then(|s| s.available_replicas), Some(1));
        assert!(d.status.as_ref().is_some_and(|s| s.conditions.is_none() && s.replicas.is_none()));

        let mut c: CronJob = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "r", "uid": "cu", "generation": 2, "labels": {"a": "b"},
                         "ownerReferences": [{"apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup", "name": "p", "uid": "o"}]},
            "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": {"spec": {"containers": []}}}}},
            "status": {"lastScheduleTime": "2026-01-01T00:00:00Z"}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        cronjob(&mut c);
        assert_eq!((c.metadata.uid.as_deref(), c.metadata.generation), (Some("cu"), Some(2)));
        assert_eq!(c.metadata.owner_references.as_ref().map(Vec::len), Some(1));
        assert!(c.metadata.labels.is_none() && c.spec.is_none() && c.status.is_none());

        let mut p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "w-1", "uid": "pu", "labels": {"x": "y"}},
            "spec": {"containers": [{"name": "c", "image": "i"}]}, "status": {"phase": "Running"}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        pod(&mut p);
        assert_eq!((p.metadata.name.as_deref(), p.metadata.uid.as_deref()), (Some("w-1"), Some("pu")));
        assert!(p.metadata.labels.is_some() && p.spec.is_none() && p.status.is_none());
    }
}
