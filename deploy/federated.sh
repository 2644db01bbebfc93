#!/usr/bin/env bash
# A federation on one machine in the default, federated topology, step by step with the commands
# an operator runs: a registry (with an audit log and the relay), three sites that register and
# publish and then run their own `msa-fed site serve` process (it dials out; no listening
# socket), the job (`msa-fed run --job job.toml`: a Ray instance for the coordinator only, no
# labelled data in it), then the model listed, shown, downloaded, opened and reported, and each
# site's status.  The job's traffic with each site is sealed end to end, as by default: each site
# has a sealing key (`msa-fed site keygen`), the consortium a job key (`msa-fed job keygen`) that
# the sites pin, and the job pins each site's key fingerprint; the registry relays what it can
# neither read nor forge.
#
#   make federation                         # or: deploy/federated.sh
#   BASE_PORT=31000 KEEP=1 deploy/federated.sh
#
# Ports: BASE_PORT (default 27300) is the registry, BASE_PORT+1.. are Ray's (GCS, client server,
# agents, node and object managers, workers BASE_PORT+100..199): never Ray's defaults (6379, 8265,
# 10001), so it runs next to any other local Ray.  Everything is on loopback; the registry is
# plaintext by --insecure (loopback only).  Everything lives in one temporary folder, removed at
# the end unless KEEP=1; the processes started here are stopped by PID.  The cluster topology
# (one Ray cluster, a node per site) is `make federation-cluster` (deploy/federation.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
RAY="${RAY:-$(dirname "$PY")/ray}"
BASE_PORT="${BASE_PORT:-27300}"
REGISTRY_PORT="$BASE_PORT"
GCS_PORT=$((BASE_PORT + 1))
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export GRPC_VERBOSITY=ERROR MSA_FED_PROGRESS=lines
unset RAY_ADDRESS
msa_fed() { "$PY" -m msa_fed.cli "$@"; }
step() { printf '\n== %s\n' "$*"; }

WORK="$(mktemp -d /tmp/msa-fed-federated.XXXXXX)"   # short: Ray's socket paths live under it
REGISTRY_PID="" RAY_PID="" SITE_PIDS=()
cleanup() {
    local rc=$?
    for pid in "${SITE_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true; done
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

step "registry on $REG (SQLite $DB, audit log $WORK/audit.jsonl, relay for the site processes)"
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
    X_unlabeled = d["X_unlabeled"].astype(np.float32)  # the registry keeps the sample as float32
    np.save(site / "unlabeled.npy", X_unlabeled)
    np.savez(site / "data.npz", X_labeled=d["X_labeled"], y_labeled=d["y_labeled"], X_unlabeled=X_unlabeled)
    print(f"site {name}: {len(d['y_labeled'])} labelled points (private), {len(d['X_unlabeled'])} unlabelled")
PYEOF
step "the consortium's job key (it signs every job; each site pins its fingerprint)"
# keygen prints the key's fingerprint: the line the other parties pin
keygen() { local out; out="$(msa_fed "$@")"; echo "$out" >&2; sed -n 's/^fingerprint \([0-9a-f]\{64\}\).*/\1/p' <<< "$out"; }
JOB_FP="$(keygen job keygen --out "$WORK/job.key")"; [ ${#JOB_FP} = 64 ]
SEAL_SITES=()
for site in north east west; do
    S="$WORK/sites/$site"
    msa_fed admin issue-token --db "$DB" --site "$site" > "$S/token" 2>/dev/null
    chmod 600 "$S/token"
    # the site's sealing key (private half mode 0600): the job's traffic with it is sealed end to end
    SITE_FP="$(keygen site keygen --out "$S/site.key")"; [ ${#SITE_FP} = 64 ]
    SEAL_SITES+=("\"$site=$SITE_FP\"")
    cat > "$S/site.toml" <<TOMLEOF
name = "$site"
registry = "$REG"
insecure = true
token_file = "token"
data = "data.npz"
predictor = "predictor.onnx"
audit_log = "state/audit.jsonl"
accept_jobs = "admin"
seal_key = "site.key"
job_keys = ["$JOB_FP"]
TOMLEOF
    SITE=(--registry "$REG" --insecure --token-file "$S/token")
    msa_fed site register "${SITE[@]}" --name "$site" --seal-key "$S/site.key.pub"
    # --config: the sample is checked to share no row with the site's data file (site.toml's data)
    msa_fed site publish --config "$S/site.toml" --predictor "$S/predictor.onnx" --unlabeled "$S/unlabeled.npy"
done

step "each site starts its own process: msa-fed site serve --config site.toml"
for site in north east west; do
    (cd "$WORK/sites/$site" && exec "$PY" -m msa_fed.cli site serve --config site.toml) > "$WORK/sites/$site/serve.log" 2>&1 &
    SITE_PIDS+=($!)
done
for site in north east west; do
    for _ in $(seq 1 240); do grep -q "connected to the registry" "$WORK/sites/$site/serve.log" && break; sleep 0.5; done
    grep "connected to the registry" "$WORK/sites/$site/serve.log" || { cat "$WORK/sites/$site/serve.log"; exit 1; }
done
msa_fed admin site-status "${ADMIN[@]}"

step "the coordinator's Ray on 127.0.0.1:$GCS_PORT (no labelled data in it)"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$WORK/ray_token"
(umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$RAY_AUTH_TOKEN_PATH")
chmod 600 "$RAY_AUTH_TOKEN_PATH"
"$RAY" start --head --block --node-ip-address=127.0.0.1 \
    --port="$GCS_PORT" --ray-client-server-port=$((BASE_PORT + 2)) --include-dashboard=false \
    --dashboard-agent-listen-port=$((BASE_PORT + 3)) --dashboard-agent-grpc-port=$((BASE_PORT + 4)) \
    --runtime-env-agent-port=$((BASE_PORT + 5)) --metrics-export-port=$((BASE_PORT + 6)) \
    --node-manager-port=$((BASE_PORT + 7)) --object-manager-port=$((BASE_PORT + 8)) \
    --min-worker-port=$((BASE_PORT + 100)) --max-worker-port=$((BASE_PORT + 199)) \
    --num-cpus=2 --temp-dir="$WORK/ray" --disable-usage-stats > "$WORK/ray.log" 2>&1 &
RAY_PID=$!
for _ in $(seq 1 240); do
    grep -q "block forever" "$WORK/ray.log" && break
    kill -0 "$RAY_PID" 2>/dev/null || { cat "$WORK/ray.log"; exit 1; }
    sleep 0.5
done
grep -q "block forever" "$WORK/ray.log" || { cat "$WORK/ray.log"; exit 1; }
echo "ray: started (log $WORK/ray.log)"

step "the job: msa-fed run --job job.toml (topology federated)"
cat > "$WORK/job.toml" <<TOMLEOF
name = "walkthrough"

[registry]
address = "$REG"
insecure = true
admin_token_file = "$WORK/admin_token"

[run]
topology = "federated"
ray_address = "127.0.0.1:$GCS_PORT"
checkpoint_dir = "$WORK/checkpoint"
output_version = "walkthrough-v1"

[sealing]
job_key = "$WORK/job.key"
sites = [$(IFS=,; echo "${SEAL_SITES[*]}")]
TOMLEOF
(cd "$WORK" && msa_fed run --job "$WORK/job.toml" --output "$WORK/job-output")

step "the stored model"
msa_fed model list "${ADMIN[@]}"
msa_fed job list "${ADMIN[@]}"
msa_fed model show latest "${ADMIN[@]}"
msa_fed model download latest --out "$WORK/downloaded" "${ADMIN[@]}"
"$PY" -c "
import sys, msa_fed
m = msa_fed.load_model(sys.argv[1])
print('loaded with msa_fed.load_model:', m.method, 'over', ', '.join(m.site_names), 'z =', ' '.join(f'{float(v):.4f}' for v in m.z))
" "$WORK/downloaded"
msa_fed model report latest --out "$WORK/report.html" "${ADMIN[@]}"

step "each site's own view"
for site in north east west; do
    msa_fed site status --config "$WORK/sites/$site/site.toml"
    grep -h "joined job\|ended;" "$WORK/sites/$site/serve.log"
done
echo "audit log: $(wc -l < "$WORK/audit.jsonl") RPCs recorded in $WORK/audit.jsonl"
step "federation walkthrough finished"
