//! Which resources name which (stream, group): kept from the resource
//! watch's events, so finding the other claimants of a group costs a
//! lookup, not a scan of every resource on every reconcile (which made a
//! fleet's poll quadratic).

use kube::core::DeserializeGuard;
use kube::runtime::watcher::Event;
use kube::{Resource as _, ResourceExt as _};
use std::collections::{BTreeSet, HashMap};
use streamfleet_crd::StreamConsumerGroup;

type Group = (String, String);

#[derive(Default)]
struct Index {
    by_group: HashMap<Group, BTreeSet<String>>,
    of_key: HashMap<String, Group>,
}

impl Index {
    fn remove(&mut self, key: &str) {
        if let Some(group) = self.of_key.remove(key)
            && let Some(keys) = self.by_group.get_mut(&group)
        {
            keys.remove(key);
            if keys.is_empty() {
                self.by_group.remove(&group);
            }
        }
    }

    /// Indexes a resource as it is now; one that does not parse names no
    /// group (it claims nothing until it does).
    fn apply(&mut self, object: &DeserializeGuard<StreamConsumerGroup>) {
        let Some(key) = key_of(object) else { return };
        self.remove(&key);
        if let Ok(scg) = &object.0 {
            let group = (scg.spec.stream.clone(), scg.spec.group.clone());
            self.by_group.entry(group.clone()).or_default().insert(key.clone());
            self.of_key.insert(key, group);
        }
    }
}

fn key_of(object: &DeserializeGuard<StreamConsumerGroup>) -> Option<String> {
    let meta = object.meta();
    Some(named(meta.namespace.as_deref().unwrap_or_default(), meta.name.as_deref()?))
}

/// The index, and the one being rebuilt while the watch re-lists.
#[derive(Default)]
pub struct ClaimantIndex {
    current: Index,
    relisting: Option<Index>,
}

impl ClaimantIndex {
    /// Follows one event of the resource watch (after the cache took it).
    pub fn observe(&mut self, event: &Event<DeserializeGuard<StreamConsumerGroup>>) {
        match event {
            Event::Apply(object) => self.current.apply(object),
            Event::Delete(object) => {
                if let Some(key) = key_of(object) {
                    self.current.remove(&key);
                }
            }
            Event::Init => self.relisting = Some(Index::default()),
            Event::InitApply(object) => {
                if let Some(relisting) = self.relisting.as_mut() {
                    relisting.apply(object);
                }
            }
            Event::InitDone => {
                if let Some(relisting) = self.relisting.take() {
                    self.current = relisting;
                }
            }
        }
    }

    /// `namespace/name` of every resource naming `scg`'s stream and group,
    /// `scg` included when it is indexed.
    pub fn naming_the_group_of(&self, scg: &StreamConsumerGroup) -> Vec<String> {
        self.current
            .by_group
            .get(&(scg.spec.stream.clone(), scg.spec.group.clone()))
            .map(|keys| keys.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// `namespace/name` of a resource.
pub fn key(scg: &StreamConsumerGroup) -> String {
    named(&scg.namespace().unwrap_or_default(), &scg.name_any())
}

/// The key of the resource `name` in `namespace`: how the operator's
/// memory, the claimant index and the logs name a resource.
pub fn named(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scg(name: &str, stream: &str, group: &str) -> DeserializeGuard<StreamConsumerGroup> {
        DeserializeGuard(Ok(serde_json::from_value(serde_json::json!({
            "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {
                "redis": {"urlSecretRef": {"name": "redis", "key": "url"}},
                "stream": stream, "group": group,
                "worker": {"template": {"spec": {"containers": [{"name": "w", "image": "worker"}]}}}
            }
        }))
        .unwrap()))
    }

    fn of(index: &ClaimantIndex, stream: &str, group: &str) -> Vec<String> {
        let DeserializeGuard(Ok(probe)) = scg("probe", stream, group) else { unreachable!() };
        index.naming_the_group_of(&probe)
    }

    #[test]
    fn a_resource_is_found_by_its_group_and_moves_with_its_spec() {
        let mut index = ClaimantIndex::default();
        index.observe(&Event::Apply(scg("a", "orders", "billing")));
        index.observe(&Event::Apply(scg("b", "orders", "billing")));
        index.observe(&Event::Apply(scg("c", "orders", "shipping")));
        assert_eq!(of(&index, "orders", "billing"), ["shop/a", "shop/b"]);
        // b now names another group: found there, and only there.
        index.observe(&Event::Apply(scg("b", "orders", "shipping")));
        assert_eq!(of(&index, "orders", "billing"), ["shop/a"]);
        assert_eq!(of(&index, "orders", "shipping"), ["shop/b", "shop/c"]);
        index.observe(&Event::Delete(scg("a", "orders", "billing")));
        assert!(of(&index, "orders", "billing").is_empty());
    }

    #[test]
    fn a_relist_replaces_the_index_only_when_it_is_done() {
        let mut index = ClaimantIndex::default();
        index.observe(&Event::Apply(scg("gone", "orders", "billing")));
        index.observe(&Event::Init);
        index.observe(&Event::InitApply(scg("kept", "orders", "billing")));
        // Mid-relist, the last complete view answers.
        assert_eq!(of(&index, "orders", "billing"), ["shop/gone"]);
        index.observe(&Event::InitDone);
        assert_eq!(of(&index, "orders", "billing"), ["shop/kept"]);
    }
}
