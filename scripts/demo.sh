#!/usr/bin/env bash
# The main job, locally: bring up the embedded control plane (etcd,
# kube-apiserver, kube-controller-manager, kubelet stand-in) and Redis,
# install streamfleet with Helm (the operator runs as a pod with the chart's
# RBAC), apply the example order pipeline, produce orders (a few poison, one
# malformed), kill a worker mid-flight, and show what happens with kubectl.
#
# Interactive (a terminal): keeps everything running afterwards for you to
# explore, until Ctrl-C. Otherwise, or with --exit: tears down at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
keep=0
[ -t 0 ] && [ -t 1 ] && keep=1
[ "${1:-}" = "--exit" ] && keep=0
orders=${DEMO_ORDERS:-2000}

say() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

say "Installing what is needed (cached after the first run)"
bash scripts/install-deps.sh
bash scripts/build-tools.sh
cargo build --workspace --bins --quiet

dir=$root/target/demo
rm -rf "$dir" && mkdir -p "$dir"
say "Starting the local control plane and Redis"
target/debug/testbed up "$dir" > "$dir/testbed.log" 2>&1 &
bed=$!
cleanup() { kill "$bed" 2>/dev/null || true; wait "$bed" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 1 300); do
  [ -f "$dir/ready" ] && break
  kill -0 "$bed" 2>/dev/null || { cat "$dir/testbed.log"; exit 1; }
  sleep 1
done
[ -f "$dir/ready" ] || { echo "test bed did not start" >&2; cat "$dir/testbed.log"; exit 1; }

export KUBECONFIG=$dir/kubeconfig
export HELM_CACHE_HOME=$dir/helm/cache HELM_CONFIG_HOME=$dir/helm/config HELM_DATA_HOME=$dir/helm/data
export PATH=$root/target/tools/bin:$PATH
redis_url=$(cat "$dir/redis-url")
redis_port=${redis_url##*:}; redis_port=${redis_port%/}
rcli() { redis-cli -p "$redis_port" "$@"; }
kubectl get nodes

say "helm install streamfleet (the operator runs as a pod, with the chart's ServiceAccount and RBAC)"
helm install streamfleet charts/streamfleet --namespace streamfleet-system --create-namespace \
  --set log.format=text --set listenOn=podIP --wait --timeout 180s
kubectl -n streamfleet-system get deploy,pods

say "Applying the example pipeline (deploy/examples/order-pipeline.yaml)"
kubectl create namespace shop
kubectl -n shop create secret generic redis --from-literal=url="$redis_url"
kubectl -n shop apply -f deploy/examples/order-pipeline.yaml
kubectl -n shop wait scg/orders --for=condition=Ready --timeout=120s

say "kubectl get scg -w, while $orders orders arrive (3 poison, 1 malformed) and a worker is killed"
kubectl -n shop get scg -w &
watcher=$!
{
  for i in $(seq 1 "$orders"); do echo "XADD orders * order_id $i amount_cents $((100 + i))"; done
  for i in 1 2 3; do echo "XADD orders * order_id poison-$i amount_cents 100 poison 1"; done
  echo "XADD orders * order_id garbled amount_cents lots"
} | rcli > /dev/null
sleep 4
kubectl -n shop get pods -l app.kubernetes.io/component=worker -o name | head -1 \
  | xargs -r kubectl -n shop delete --grace-period=0 --force > /dev/null 2>&1 || true
for _ in $(seq 1 120); do
  charged=$(rcli HLEN '{ledger}:charges')
  dead=$(rcli XLEN '{orders}:dead:billing')
  pending=$(rcli XPENDING orders billing | head -1)
  [ "$charged" = "$orders" ] && [ "$dead" = "4" ] && [ "$pending" = "0" ] && break
  sleep 1
done
sleep 12  # a few more polls: replicas settle back, health returns to Healthy
kill "$watcher" 2>/dev/null || true
wait "$watcher" 2>/dev/null || true
total=$orders

say "kubectl get scg -n shop"
kubectl -n shop get scg
kubectl -n shop get deploy,cronjob,pods
say "Dead letters (reason and error of each)"
rcli --no-raw XRANGE '{orders}:dead:billing' - + | grep -A1 -E '"streamfleet\.(reason|error|business-key)"' | grep -v -- '--' | paste - - | head -12
say "Ledger: every order charged exactly once?"
echo "orders charged: $(rcli HLEN '{ledger}:charges') of $total; duplicate charges refused by the ledger: $(rcli HLEN '{ledger}:duplicates')"
say "Events"
kubectl -n shop get events --field-selector involvedObject.kind=StreamConsumerGroup 2>/dev/null | tail -5 || true

if [ "$keep" = 1 ]; then
  say "Everything keeps running. In another terminal:"
  echo "  export KUBECONFIG=$KUBECONFIG PATH=$root/target/tools/bin:\$PATH"
  echo "  kubectl get scg -A -w"
  echo "  redis-cli -p $redis_port XADD orders '*' order_id 9999 amount_cents 5"
  echo "Ctrl-C stops the control plane and Redis."
  wait "$bed"
fi
