#!/usr/bin/env bash
# A whole federation on one machine, step by step, with the commands an operator runs:
# a registry (with an audit log), three sites that register and publish, a Ray cluster whose
# node carries the three sites' resources, the job (cluster/jobs/run_msa.py, as `ray submit`
# runs it), then the model listed, downloaded, opened and reported.
#
#   make federation-cluster                 # or: deploy/federation.sh
#   (make federation: the default, federated topology, deploy/federated.sh)
#   BASE_PORT=31000 KEEP=1 deploy/federation.sh
#
# Ports: BASE_PORT (default 27100) is the registry, BASE_PORT+1.. are Ray's (GCS, client
# server, agents, node and object managers, workers BASE_PORT+100..199): nothing here uses
# Ray's defaults (6379, 8265, 10001), so it runs next to any other local Ray.  Everything is
# on loopback; the registry is plaintext by --insecure (loopback only), Ray uses token
# authentication with a token generated for this run.  Everything lives in one temporary
# folder, removed at the end unless KEEP=1; the processes started here are stopped by PID.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
RAY="${RAY:-$(dirname "$PY")/ray}"
BASE_PORT="${BASE_PORT:-27100}"
REGISTRY_PORT="$BASE_PORT"
GCS_PORT=$((BASE_PORT + 1))
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export GRPC_VERBOSITY=ERROR
unset RAY_ADDRESS
msa_fed() { "$PY" -m msa_fed.cli "$@"; }
step() { printf '\n== %s\n' "$*"; }

WORK="$(mktemp -d /tmp/msa-fed-federation.XXXXXX)"   # short: Ray's socket paths live under it
REGISTRY_PID="" RAY_PID=""
cleanup() {
    local rc=$?
    [ -n "$RAY_PID" ] && kill -TERM "$RAY_PID" 2>/dev/null && wait "$RAY_PID" 2>/dev/null || true
    # what `ray start --block` leaves (its client server names no temp dir): this Ray only, never `ray stop`
    [ -d "$WORK/ray" ] && "$PY" -m msa_fed.runtime.ray_own stop --temp-dir "$WORK/ray" --grace 5 > /dev/null 2>&1 || true
    [ -n "$REGISTRY_PID" ] && kill -TERM "$REGISTRY_PID" 2>/dev/null && wait "$REGISTRY_PID" 2>/dev/null || true
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
    exit $rc
}
trap cleanup EXIT INT TERM
REG="127.0.0.1:$REGISTRY_PORT"
DB="$WORK/registry.db"
echo "working folder: $WORK"

step "registry on $REG (SQLite $DB, audit log $WORK/audit.jsonl)"
"$PY" -m msa_fed.cli registry serve --db "$DB" --listen "$REG" --insecure --audit-log "$WORK/audit.jsonl" \
    --log-level WARNING > "$WORK/registry.log" 2>&1 &
REGISTRY_PID=$!
for _ in $(seq 1 120); do grep -q "registry listening" "$WORK/registry.log" && break; sleep 0.5; done
grep "registry listening" "$WORK/registry.log" || { cat "$WORK/registry.log"; exit 1; }
msa_fed admin issue-token --db "$DB" --admin > "$WORK/admin_token" 2>/dev/null
chmod 600 "$WORK/admin_token"
ADMIN=(--registry "$REG" --insecure --admin-token-file "$WORK/admin_token")

step "three sites: predictors and data (each site's labelled data stay in its own folder)"
"$PY" - "$WORK" <<'PYEOF'
import sys
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression

from msa_fed.artifacts.predictors import export_sklearn
from msa_fed.experiments.demo_data import SITES, make_federation

work = Path(sys.argv[1])
fed = make_federation(n_labeled=300, n_unlabeled=500, n_test=10)
for name in SITES:
    d, site = fed[name], work / "sites" / name
    site.mkdir(parents=True)
    h = LogisticRegression().fit(d["X_train"], d["y_train"])
    (site / "predictor.onnx").write_bytes(export_sklearn(h, n_features=2))
    np.save(site / "unlabeled.npy", d["X_unlabeled"])
    np.savez(site / f"{name}.npz", X_labeled=d["X_labeled"], y_labeled=d["y_labeled"], X_unlabeled=d["X_unlabeled"])
    print(f"site {name}: {len(d['y_labeled'])} labelled points (private), {len(d['X_unlabeled'])} unlabelled")
PYEOF
for site in north east west; do
    msa_fed admin issue-token --db "$DB" --site "$site" > "$WORK/sites/$site/token" 2>/dev/null
    chmod 600 "$WORK/sites/$site/token"
    SITE=(--registry "$REG" --insecure --token-file "$WORK/sites/$site/token")
    msa_fed site register "${SITE[@]}" --name "$site"
    msa_fed site publish "${SITE[@]}" --predictor "$WORK/sites/$site/predictor.onnx" \
        --unlabeled "$WORK/sites/$site/unlabeled.npy" --labeled "$WORK/sites/$site/$site.npz"
    msa_fed site heartbeat "${SITE[@]}"
done
msa_fed admin list-sites --db "$DB"

step "Ray head on 127.0.0.1:$GCS_PORT with resources site:north, site:east, site:west"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$WORK/ray_token"
(umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$RAY_AUTH_TOKEN_PATH")
chmod 600 "$RAY_AUTH_TOKEN_PATH"
# every site's data folder is "its node's disk"; MSA_FED_SITE_DATA is the parent of the three
mkdir -p "$WORK/site-data"
for site in north east west; do ln -s "$WORK/sites/$site/$site.npz" "$WORK/site-data/$site.npz"; done
MSA_FED_SITE_DATA="$WORK/site-data" "$RAY" start --head --block --node-ip-address=127.0.0.1 \
    --port="$GCS_PORT" --ray-client-server-port=$((BASE_PORT + 2)) --include-dashboard=false \
    --dashboard-agent-listen-port=$((BASE_PORT + 3)) --dashboard-agent-grpc-port=$((BASE_PORT + 4)) \
    --runtime-env-agent-port=$((BASE_PORT + 5)) --metrics-export-port=$((BASE_PORT + 6)) \
    --node-manager-port=$((BASE_PORT + 7)) --object-manager-port=$((BASE_PORT + 8)) \
    --min-worker-port=$((BASE_PORT + 100)) --max-worker-port=$((BASE_PORT + 199)) \
    --num-cpus=2 --temp-dir="$WORK/ray" --disable-usage-stats \
    --resources='{"site:north": 1, "site:east": 1, "site:west": 1}' > "$WORK/ray.log" 2>&1 &
RAY_PID=$!
for _ in $(seq 1 240); do
    grep -q "block forever" "$WORK/ray.log" && break
    kill -0 "$RAY_PID" 2>/dev/null || { cat "$WORK/ray.log"; exit 1; }
    sleep 0.5
done
grep -q "block forever" "$WORK/ray.log" || { cat "$WORK/ray.log"; exit 1; }
echo "ray: started (log $WORK/ray.log)"

step "the job (cluster/jobs/run_msa.py attaches to 127.0.0.1:$GCS_PORT)"
cat > "$WORK/job.toml" <<TOMLEOF
name = "walkthrough"

[registry]
address = "$REG"
insecure = true
admin_token_file = "$WORK/admin_token"

[run]
sites = ["north", "east", "west"]
site_data = "{site}.npz"
topology = "cluster"
ray_address = "127.0.0.1:$GCS_PORT"
output_version = "walkthrough-v1"
TOMLEOF
(cd "$WORK" && RAY_ADDRESS="127.0.0.1:$GCS_PORT" "$PY" "$REPO/cluster/jobs/run_msa.py" \
    --job "$WORK/job.toml" --output "$WORK/job-output")

step "the stored model"
msa_fed model list "${ADMIN[@]}"
msa_fed job list "${ADMIN[@]}"
msa_fed model download latest --out "$WORK/downloaded" "${ADMIN[@]}"
"$PY" -c "
import sys, msa_fed
m = msa_fed.load_model(sys.argv[1])
print('loaded with msa_fed.load_model:', m.method, 'over', ', '.join(m.site_names), 'z =', ' '.join(f'{float(v):.4f}' for v in m.z))
" "$WORK/downloaded"
msa_fed model report latest --out "$WORK/report.html" "${ADMIN[@]}"
echo "audit log: $(wc -l < "$WORK/audit.jsonl") RPCs recorded in $WORK/audit.jsonl"
step "federation walkthrough finished"
