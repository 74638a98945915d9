//! A userspace service proxy, as kube-proxy's first mode was: for every port
//! of every Service with a selector, a listener on its cluster IP (the API
//! server hands them out in its bed's range on loopback, `Slot::service_range`) that forwards each
//! connection to a ready pod the selector matches, on the target port
//! (a number, or a container port's name); and, standing in for the
//! endpointslice controller, each such Service's EndpointSlice. This is what
//! lets the API server reach an aggregated API through its Service, as in a
//! cluster.

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Pod, Service, ServicePort};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, ResourceExt as _};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Runs until dropped (its listeners are aborted with it).
pub(super) async fn proxy(client: Client) {
    let (pods, pod_writer) = reflector::store();
    let (services, service_writer) = reflector::store();
    let watch_pods = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(pod_writer)
        .for_each(|_| async {});
    let watch_services = watcher(Api::<Service>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(service_writer)
        .for_each(|_| async {});
    let _watches = (AbortOnDrop(tokio::spawn(watch_pods)), AbortOnDrop(tokio::spawn(watch_services)));
    let mut listeners: HashMap<(String, i32), Listener> = HashMap::new();
    let mut published: HashMap<String, serde_json::Value> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let services: Vec<Arc<Service>> = services.state();
        let mut wanted_listeners = HashMap::new();
        for svc in &services {
            let uid = svc.uid().unwrap_or_default();
            for (port, rule) in wanted_ports(svc) {
                wanted_listeners.insert((uid.clone(), port), rule);
            }
            if let Some(slice) = endpoint_slice(svc, &pods.state()) {
                let key = format!("{}/{}", svc.namespace().unwrap_or_default(), svc.name_any());
                if published.get(&key) != Some(&slice) && publish(&client, svc, &slice).await {
                    published.insert(key, slice);
                }
            }
        }
        let known: std::collections::HashSet<String> =
            services.iter().map(|s| format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any())).collect();
        published.retain(|key, _| known.contains(key));
        listeners.retain(|key, l| wanted_listeners.get(key).is_some_and(|w| *w == l.rule));
        for (key, rule) in wanted_listeners {
            if let std::collections::hash_map::Entry::Vacant(slot) = listeners.entry(key)
                && let Some(l) = Listener::start(rule, pods.clone()).await
            {
                slot.insert(l);
            }
        }
    }
}

/// The EndpointSlice the endpointslice controller would write for `svc`:
/// its ready pods and their ports. Pod IPs here are loopback addresses,
/// which an IPv4 slice refuses, so the slice is of type FQDN with each pod
/// IP as its name. The API server's aggregator needs it to call an
/// APIService available; it then connects through the cluster IP (this
/// proxy), never to the addresses themselves.
fn endpoint_slice(svc: &Service, pods: &[Arc<Pod>]) -> Option<serde_json::Value> {
    let rules = wanted_ports(svc);
    let any = rules.values().next()?;
    let ports: Vec<_> = svc.spec.as_ref()?.ports.iter().flatten().filter(|p| rules.contains_key(&p.port)).collect();
    let mut endpoints = Vec::new();
    let mut target_ports = BTreeMap::new();
    for pod in ready_pods(any, pods) {
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else { continue };
        for p in &ports {
            if let Some(rule) = rules.get(&p.port)
                && let Some(port) = target_port(rule, &pod)
            {
                target_ports.insert(p.name.clone().unwrap_or_default(), port);
            }
        }
        endpoints.push(serde_json::json!({"addresses": [ip], "conditions": {"ready": true}}));
    }
    let ports: Vec<_> = target_ports
        .into_iter()
        .map(|(name, port)| serde_json::json!({"name": name, "port": port, "protocol": "TCP"}))
        .collect();
    Some(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{}-testbed", svc.name_any()),
            "labels": {
                "kubernetes.io/service-name": svc.name_any(),
                "endpointslice.kubernetes.io/managed-by": "testbed-kubelet",
            },
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": svc.name_any(),
                                 "uid": svc.uid().unwrap_or_default(), "controller": true}],
        },
        "addressType": "FQDN",
        "endpoints": endpoints,
        "ports": ports,
    }))
}

async fn publish(client: &Client, svc: &Service, slice: &serde_json::Value) -> bool {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), &svc.namespace().unwrap_or_default());
    let name = format!("{}-testbed", svc.name_any());
    let pp = PatchParams::apply("testbed-kubelet").force();
    match api.patch(&name, &pp, &Patch::Apply(slice)).await {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!("publishing EndpointSlice {name}: {e}");
            false
        }
    }
}

/// Where one service port leads.
#[derive(Clone, PartialEq, Debug)]
struct Rule {
    namespace: String,
    cluster_ip: String,
    port: i32,
    target: IntOrString,
    selector: BTreeMap<String, String>,
}

/// Service port → rule, for Services the proxy serves: a cluster IP, a selector, TCP.
fn wanted_ports(svc: &Service) -> HashMap<i32, Rule> {
    let Some(spec) = &svc.spec else { return HashMap::new() };
    let (Some(ip), Some(selector)) = (spec.cluster_ip.as_deref(), spec.selector.as_ref()) else {
        return HashMap::new();
    };
    if ip == "None" || ip.is_empty() || selector.is_empty() {
        return HashMap::new();
    }
    let tcp = |p: &&ServicePort| p.protocol.as_deref().is_none_or(|proto| proto == "TCP");
    spec.ports
        .iter()
        .flatten()
        .filter(tcp)
        .map(|p| {
            let rule = Rule {
                namespace: svc.namespace().unwrap_or_default(),
                cluster_ip: ip.to_string(),
                port: p.port,
                target: p.target_port.clone().unwrap_or(IntOrString::Int(p.port)),
                selector: selector.clone(),
            };
            (p.port, rule)
        })
        .collect()
}

struct Listener {
    rule: Rule,
    _task: AbortOnDrop,
}

impl Listener {
    async fn start(rule: Rule, pods: Store<Pod>) -> Option<Self> {
        let addr = format!("{}:{}", rule.cluster_ip, rule.port);
        let listener = match tokio::net::TcpListener::bind(&addr).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("service proxy: binding {addr}: {e}");
                return None;
            }
        };
        let shared = Arc::new((rule.clone(), pods, AtomicUsize::new(0)));
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    // Out of file descriptors and the like: do not spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    let (rule, pods, next) = &*shared;
                    let Some(backend) = backend(rule, pods, next.fetch_add(1, Ordering::Relaxed)) else {
                        tracing::warn!("service proxy: no ready pod behind {}:{}", rule.cluster_ip, rule.port);
                        return;
                    };
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&backend).await else { return };
                    let mut inbound = inbound;
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        });
        Some(Self { rule, _task: AbortOnDrop(task) })
    }
}

/// Ready, not terminating pods in the rule's namespace that its selector matches.
fn ready_pods(rule: &Rule, pods: &[Arc<Pod>]) -> Vec<Arc<Pod>> {
    pods.iter()
        .filter(|p| {
            p.namespace().as_deref() == Some(rule.namespace.as_str()) && p.metadata.deletion_timestamp.is_none()
        })
        .filter(|p| rule.selector.iter().all(|(k, v)| p.labels().get(k) == Some(v)))
        .filter(|p| {
            let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
            conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .cloned()
        .collect()
}

/// The rule's target port on `pod`: a number, or a container port's name.
fn target_port(rule: &Rule, pod: &Pod) -> Option<i32> {
    match &rule.target {
        IntOrString::Int(port) => Some(*port),
        IntOrString::String(name) => pod.spec.as_ref()?.containers.iter().find_map(|c| {
            c.ports.iter().flatten().find(|cp| cp.name.as_deref() == Some(name)).map(|cp| cp.container_port)
        }),
    }
}

/// The `turn`th ready pod behind the rule, as `ip:port`.
fn backend(rule: &Rule, pods: &Store<Pod>, turn: usize) -> Option<String> {
    let mut ready: Vec<(String, i32)> = ready_pods(rule, &pods.state())
        .iter()
        .filter_map(|p| Some((p.status.as_ref()?.pod_ip.clone()?, target_port(rule, p)?)))
        .collect();
    ready.sort();
    let (ip, port) = ready.get(turn % ready.len().max(1))?;
    Some(format!("{ip}:{port}"))
}

pub(super) struct AbortOnDrop(pub(super) JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
