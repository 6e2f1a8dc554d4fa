#!/usr/bin/env bash
# End-to-end check of the Kubernetes operator on a REAL cluster. It cannot run on the development machines
# (no container runtime, no cluster), so the test suite does not run it and it is untested there.
#
#   k8s/e2e.sh                        # kind: a new cluster of 3 CPU workers, the operator counts `cpu`
#   E2E_CLUSTER=existing k8s/e2e.sh   # the current kubectl context (GPU nodes, image tenplex:latest pullable)
#
# It applies k8s/, runs the example job, scales it down and up (maxNodes), deletes a worker pod, and shows the
# job recovering and continuing. Needs kubectl (and kind + docker for the kind cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${E2E_CLUSTER:-kind}
JOB=gpt-example
say() { printf '\n== %s\n' "$*"; }
job() { kubectl get tenplexjob "$JOB" -o jsonpath="{.status.$1}"; }
wait_for() {  # FIELD VALUE: poll the job's status until .status.FIELD is VALUE (10 minutes at most)
  for _ in $(seq 600); do [ "$(job "$1")" = "$2" ] && { kubectl get tenplexjob "$JOB"; return; }; sleep 1; done
  echo "timed out waiting for .status.$1=$2" >&2; kubectl describe tenplexjob "$JOB" >&2; exit 1
}

say "cluster and image"
if [ "$CLUSTER" = kind ]; then
  kind get clusters | grep -qx tenplex-e2e || kind create cluster --name tenplex-e2e --config - <<'YAML'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes: [{role: control-plane}, {role: worker}, {role: worker}, {role: worker}]
YAML
  docker build -t tenplex:latest -f k8s/Dockerfile .
  kind load docker-image tenplex:latest --name tenplex-e2e
fi

say "operator, stores, rendezvous"
kubectl apply -k k8s/
kubectl -n tenplex-system get secret tenplex-store-token >/dev/null 2>&1 ||
  kubectl -n tenplex-system create secret generic tenplex-store-token --from-literal=token="$(openssl rand -hex 32)"
kubectl label nodes -l '!node-role.kubernetes.io/control-plane' tenplex.io/gpu-node=true --overwrite
if [ "$CLUSTER" = kind ]; then
  kubectl -n tenplex-system set env deployment/tenplex-operator TENPLEX_GPU_RESOURCE=cpu
fi
# The example dataset on every node (each job's worker pods mount their own view of it: tenplex run --data-mount).
kubectl -n tenplex-system apply -f - <<'YAML'
apiVersion: batch/v1
kind: Job
metadata: {name: tenplex-e2e-dataset}
spec:
  completions: 3
  parallelism: 3
  completionMode: Indexed
  template:
    spec:
      restartPolicy: OnFailure
      topologySpreadConstraints:
        - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule,
           labelSelector: {matchLabels: {batch.kubernetes.io/job-name: tenplex-e2e-dataset}}}
      nodeSelector: {tenplex.io/gpu-node: "true"}
      containers:
        - name: pack
          image: tenplex:latest
          imagePullPolicy: IfNotPresent
          command: [sh, -c, 'd=/var/lib/tenplex/datasets/example; [ -f $d/state.json ] && exit 0;
            python -c "import numpy as n; n.random.default_rng(0).integers(0, 256, 64*4096, dtype=n.uint16).tofile(\"/tmp/t.bin\")" &&
            tenplex data pack /tmp/t.bin $d --seq-len 64 --dtype uint16 --quiet &&
            tenplex data state $d --seed 0 --global-batch 16 --dp 1 -o $d/state.json']
          volumeMounts: [{name: datasets, mountPath: /var/lib/tenplex/datasets}]
      volumes: [{name: datasets, hostPath: {path: /var/lib/tenplex/datasets, type: DirectoryOrCreate}}]
YAML
kubectl -n tenplex-system wait job/tenplex-e2e-dataset --for=condition=complete --timeout=600s
kubectl -n tenplex-system rollout status deployment/tenplex-operator deployment/tenplex-rendezvous --timeout=600s
kubectl -n tenplex-system rollout status daemonset/tenplex-store --timeout=600s

say "the example job on every node"
if [ "$CLUSTER" = kind ]; then  # 1 cpu per node as the "accelerator", no pinned 24-rank configuration
  sed -e 's/gpusPerNode: 8/gpusPerNode: 1/' -e '/pinned:/,+1d' -e '/^  resources:/,+1d' -e 's/maxNodes: 4/maxNodes: 3/' \
    k8s/examples/tenplexjob.yaml | kubectl apply -f -
else
  kubectl apply -f k8s/examples/tenplexjob.yaml
fi
wait_for phase Running

say "scale down to 2 nodes (maxNodes), then back up"
kubectl patch tenplexjob "$JOB" --type merge -p '{"spec":{"maxNodes":2}}'
wait_for nodes 2
kubectl patch tenplexjob "$JOB" --type merge -p '{"spec":{"maxNodes":3}}'
wait_for nodes 3

say "delete a worker pod: the operator replaces it and the job continues"
victim=$(kubectl get pods -l tenplex.io/job=$JOB,tenplex.io/role=worker -o jsonpath='{.items[0].metadata.name}')
kubectl delete pod "$victim"
wait_for lastRescale.type Recovery
wait_for phase Running
kubectl get events --field-selector involvedObject.name=$JOB --sort-by=.lastTimestamp | tail -n 20
kubectl logs -l tenplex.io/job=$JOB,tenplex.io/role=worker --tail=5 --prefix
say "ok: $(job lastRescale.reason)"
