#!/usr/bin/env bash
# The one-machine `ray up` / `ray submit` recipe: the cluster launcher's local provider, with this
# machine as "the head", reached over SSH as a dedicated login.  docs/OPERATIONS.md ("ray up on one
# machine") walks through it; tests/ops/test_ops_ray_up.py runs it.
#
#   sudo deploy/ray-up-local.sh up   FOLDER     # login, private sshd, FOLDER/cluster.yaml
#   ray up -y FOLDER/cluster.yaml
#   ray submit FOLDER/cluster.yaml cluster/jobs/run_msa.py --job ~/msa-fed/jobs/job.toml
#   sudo deploy/ray-up-local.sh down FOLDER     # stops that Ray and the sshd, removes the login
#
# What it sets up (root, OpenSSH's sshd, ssh-keygen and rsync are needed):
# - a login LOGIN (default msafed-local) whose home is FOLDER/home and whose ~/.bashrc puts this
#   Python environment on PATH: `ray up` and `ray submit` log in and run a login shell.  The
#   environment may live where no other user can read it (a venv under /root), so the login is
#   an alias of the invoking user's uid with its own home: the launcher's `~` paths land in FOLDER;
# - an sshd on 127.0.0.1 on a free port, with a host key and an authorised key made here; the
#   launcher has no SSH port setting, so `auth.ssh_proxy_command` relays to that port;
# - FOLDER/cluster.yaml: Ray started by `head_start_ray_commands` on ports BASE_PORT+1.. (never
#   Ray's defaults), with its own --temp-dir FOLDER/ray, stopped only by that temp dir
#   (python -m msa_fed.runtime.ray_own; never `ray stop`, which stops every Ray of the user);
#   FOLDER/jobs is copied to ~/msa-fed/jobs on the head (put the job file and its token there).
#   Ray runs with its token check (RAY_AUTH_MODE=token; the token in FOLDER/home/.ray/auth_token,
#   mode 0600), and in the login's shell `ray stop` (Ray's banner names it) stops only this Ray.
#   `down` stops every process of that Ray, its client server (ray.util.client.server) included.
#   SITE_RESOURCES (default the demo's three sites) are the head node's custom resources.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
LOGIN="${LOGIN:-msafed-local}"
BASE_PORT="${BASE_PORT:-27600}"
SITE_RESOURCES="${SITE_RESOURCES:-}"
[ -n "$SITE_RESOURCES" ] || SITE_RESOURCES='{"site:north": 1, "site:east": 1, "site:west": 1}'
action="${1:-}" FOLDER="${2:-}"
[ -n "$action" ] && [ -n "$FOLDER" ] || { echo "usage: $0 up|down FOLDER" >&2; exit 2; }
FOLDER="$(mkdir -p "$FOLDER" && cd "$FOLDER" && pwd)"

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

down() {
    if [ -f "$FOLDER/sshd.pid" ]; then kill -TERM "$(cat "$FOLDER/sshd.pid")" 2>/dev/null || true; fi
    PYTHONPATH="$REPO" "$PY" -m msa_fed.runtime.ray_own stop --temp-dir "$FOLDER/ray" || true
    if id "$LOGIN" > /dev/null 2>&1 && [ "$(getent passwd "$LOGIN" | cut -d: -f6)" = "$FOLDER/home" ]; then
        userdel -f "$LOGIN" 2>/dev/null || true   # the alias only (-f: its uid is in use)
    fi
    echo "stopped: sshd, the Ray of $FOLDER/ray; login $LOGIN removed"
}

up() {
    [ "$(id -u)" = 0 ] || { echo "error: run as root (it adds a login and starts an sshd)" >&2; exit 1; }
    for tool in /usr/sbin/sshd ssh-keygen rsync; do
        command -v "$tool" > /dev/null || { echo "error: $tool is missing (apt-get install openssh-server rsync)" >&2; exit 1; }
    done
    if id "$LOGIN" > /dev/null 2>&1; then
        echo "error: a login $LOGIN exists already; remove it (userdel -f $LOGIN) or set LOGIN=another" >&2
        exit 1
    fi
    chmod 755 "$FOLDER"
    mkdir -p "$FOLDER/home/.ssh" "$FOLDER/jobs" "$FOLDER/ray"
    useradd -o -u "$(id -u)" -g "$(id -g)" -M -d "$FOLDER/home" -s /bin/bash "$LOGIN"
    usermod -p '*' "$LOGIN"   # no password, but not a locked account
    ssh-keygen -q -t ed25519 -N "" -f "$FOLDER/id_ed25519"
    ssh-keygen -q -t ed25519 -N "" -f "$FOLDER/host_key"
    cp "$FOLDER/id_ed25519.pub" "$FOLDER/home/.ssh/authorized_keys"
    chmod 700 "$FOLDER/home/.ssh"
    # Ray's token check: a token made here, readable by the login only (~/.ray/auth_token is
    # where Ray looks for it with RAY_AUTH_MODE=token)
    mkdir -p "$FOLDER/home/.ray"
    chmod 700 "$FOLDER/home/.ray"
    (umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$FOLDER/home/.ray/auth_token")
    chmod 600 "$FOLDER/home/.ray/auth_token"
    cat > "$FOLDER/home/.bashrc" <<EOF
export PATH=$(dirname "$PY"):\$PATH
export PYTHONPATH=$REPO
export GRPC_VERBOSITY=ERROR
export RAY_AUTH_MODE=token
# Ray's banner and 'ray down' say 'ray stop', which stops every Ray of the account: in this login
# it stops only this recipe's Ray ('command ray stop' would stop them all)
ray() { if [ "\${1:-}" = stop ]; then python -m msa_fed.runtime.ray_own stop --temp-dir $FOLDER/ray; else command ray "\$@"; fi; }
EOF
    local port
    port="$(free_port)"
    cat > "$FOLDER/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $FOLDER/host_key
PidFile $FOLDER/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowUsers $LOGIN
PermitRootLogin prohibit-password
StrictModes no
EOF
    cat > "$FOLDER/proxy.py" <<'EOF'
import socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while True:
        b = sys.stdin.buffer.raw.read(65536)
        if not b:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(b)
threading.Thread(target=up, daemon=True).start()
while True:
    b = s.recv(65536)
    if not b:
        break
    sys.stdout.buffer.write(b)
    sys.stdout.buffer.flush()
EOF
    mkdir -p /run/sshd
    /usr/sbin/sshd -f "$FOLDER/sshd_config" -E "$FOLDER/sshd.log"
    for _ in $(seq 1 100); do [ -s "$FOLDER/sshd.pid" ] && break; sleep 0.1; done
    local gcs=$((BASE_PORT + 1)) b=$BASE_PORT
    "$PY" - "$FOLDER" "$LOGIN" "$port" "$gcs" "$b" "$SITE_RESOURCES" "$PY" <<'EOF'
import json, secrets, sys
folder, login, port, gcs, base, resources, py = sys.argv[1:]
gcs, base = int(gcs), int(base)
start = (
    f"RAY_AUTH_MODE=token ray start --head --node-ip-address=127.0.0.1 --port={gcs} --ray-client-server-port={base + 2} "
    f"--include-dashboard=false --dashboard-agent-listen-port={base + 3} --dashboard-agent-grpc-port={base + 4} "
    f"--runtime-env-agent-port={base + 5} --metrics-export-port={base + 6} --node-manager-port={base + 7} "
    f"--object-manager-port={base + 8} --min-worker-port={base + 100} --max-worker-port={base + 199} "
    f"--num-cpus=2 --temp-dir={folder}/ray --disable-usage-stats --resources='{resources}'"
)
stop = f"python -m msa_fed.runtime.ray_own stop --temp-dir {folder}/ray"
config = {
    "cluster_name": f"msafed-local-{secrets.token_hex(3)}",
    "provider": {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
    "auth": {
        "ssh_user": login,
        "ssh_private_key": f"{folder}/id_ed25519",
        "ssh_proxy_command": f"{py} {folder}/proxy.py 127.0.0.1 {port}",
    },
    "min_workers": 0,
    "max_workers": 0,
    "file_mounts": {"~/msa-fed/jobs": f"{folder}/jobs"},
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    # `ray start` gives up when its raylet has not registered within 30 s (fixed in Ray): on a
    # loaded node, stop what it left and start once more
    "head_start_ray_commands": [stop, f"{start} || ({stop} && sleep 2 && {start})"],
    "worker_start_ray_commands": [],
}
with open(f"{folder}/cluster.yaml", "w") as f:
    json.dump(config, f, indent=2)  # YAML is a superset of JSON
EOF
    echo "login $LOGIN (home $FOLDER/home), sshd on 127.0.0.1:$port, Ray GCS to be on 127.0.0.1:$gcs"
    echo "next: ray up -y $FOLDER/cluster.yaml; ray submit $FOLDER/cluster.yaml cluster/jobs/run_msa.py --job ~/msa-fed/jobs/job.toml"
}

case "$action" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down FOLDER" >&2; exit 2 ;;
esac
