"""`nebula-rl slurm`: an sbatch script that runs an RL job over the nodes of a Slurm allocation.

The script is plain bash, rendered here from the config and the flags; what it does when the job
starts, on the allocation's nodes (`scontrol show hostnames`, in order):

1. node 0 (where Slurm runs the batch script): builds the warm-start model if the config asks for
   one (:func:`prepare`, as `nebula-rl train` does), makes the job's token and a Redis password,
   starts Redis bound to node 0's address with that password, then the controller on the same
   address; it waits for the controller's `/health`;
2. every replica: `srun --nodes=1 --ntasks=1 --nodelist=<node> --overlap ... nebula-rl replica`,
   placed by :func:`place_on_nodes` (each replica on one node, its GPUs in
   CUDA_VISIBLE_DEVICES);
3. waits for the controller to end (its exit code is the job's), ends the job when every replica
   of a role has failed, and on exit (also on SIGTERM, e.g. `scancel` or the time limit) stops
   the replicas, the controller and Redis, in that order.

Secrets are made inside the job and reach the processes through their environment (the token in
`NEBULA_TOKEN`, which srun passes on) and a file only the user can read (Redis's config): never a
command line, which `ps` shows to every user of a node, nor the script, which sits on a shared
disk. Simplifications against `nebula-rl train`: a controller that dies is not restarted, and a
replica never spans nodes.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from nebula_rl import __version__
from nebula_rl.config import Config, GrpoConfig
from nebula_rl.controller.client import TOKEN_ENV
from nebula_rl.launch import Placement, plan_placement

__all__ = ["SlurmJob", "place_on_nodes", "prepare", "render_sbatch", "submit"]

HEAD_ADDR_ENV = "NEBULA_HEAD_ADDR"
"""Set (at submission) to the address the other nodes reach node 0 at, when its hostname does
not resolve to it (e.g. to the IP of a fast interface)."""


@dataclass(frozen=True)
class SlurmJob:
    """What `nebula-rl slurm` was asked for (its flags, resolved)."""

    config_path: Path
    """The job's config file (absolute: every node reads it)."""
    num_nodes: int
    """`--nodes`."""
    gpus_per_node: int = 8
    """`--gpus-per-node` (0: replicas are CPU processes)."""
    num_policy: int | None = None
    """`--policy` (default: policy.parallelism.n_init_replicas)."""
    num_rollout: int | None = None
    """`--rollout` (default: rollout.parallelism.n_init_replicas)."""
    partition: str = ""
    """`--partition` (empty: the cluster's default)."""
    account: str = ""
    """`--account` (empty: the user's default)."""
    time: str = ""
    """`--time` limit, Slurm's format (e.g. `04:00:00`; empty: the partition's default)."""
    job_name: str = "nebula-rl"
    """`--job-name`."""
    output_dir: Path | None = None
    """`--output-dir`: where the run folder goes (default: train.output_dir)."""
    port: int = 0
    """`--port` of the controller on node 0 (0: a free one, picked when the job starts)."""
    workdir: Path = Path(".")
    """Folder the job runs in (relative paths of the config are read from it)."""
    python: str = sys.executable
    """The Python that has nebula-rl installed, on every node."""


_HEADER_VALUE = re.compile(r"[A-Za-z0-9_.,:@+=-]+")
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")


def _check_job(cfg: Config, job: SlurmJob) -> None:
    """Refuse flags and configs the script cannot run, naming them."""
    if not isinstance(cfg.train.train_policy, GrpoConfig):
        raise ValueError(
            f'train.train_policy.type = "{cfg.train.train_policy.type}": nebula-rl slurm runs RL '
            'jobs (type = "grpo": a controller and replicas); run SFT with `nebula-rl train`'
        )
    if cfg.train.train_policy.uncentralized_training:
        raise ValueError(
            "train.train_policy.uncentralized_training = true runs a world model on the "
            "policy's ranks in one job, without replicas: run it with `nebula-rl train`"
        )
    if cfg.distillation.enable:
        raise ValueError(
            "distillation.enable: the sbatch script places no teacher replicas yet; run "
            "`nebula-rl train` on one node, or start teachers by hand with `nebula-rl replica "
            "--role teacher --controller HOST:PORT`"
        )
    if job.num_nodes < 1:
        raise ValueError(f"--nodes must be at least 1 (got {job.num_nodes})")
    if job.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be 0 or more (got {job.gpus_per_node})")
    if not 0 <= job.port <= 65535:
        raise ValueError(f"--port must be in 0-65535 (got {job.port})")
    # (#SBATCH lines are read by sbatch, not the shell: no quoting there)
    for flag, value in (
        ("--partition", job.partition),
        ("--account", job.account),
        ("--job-name", job.job_name),
    ):
        if value and not _HEADER_VALUE.fullmatch(value):
            raise ValueError(f"{flag} {value!r}: use letters, digits and _.,:@+=- only")
    if job.time and not _TIME.fullmatch(job.time):
        raise ValueError(
            f"--time {job.time!r}: use Slurm's format, e.g. 04:00:00, 90 (minutes) or 1-00:00:00"
        )


def _keys(role: str) -> str:
    return (
        "policy.parallelism: pp_size * dp_replicate_size * dp_shard_size * cp_size * tp_size"
        if role == "policy"
        else "rollout.parallelism.tp_size * pp_size"
    )


def place_on_nodes(
    cfg: Config, *, num_policy: int, num_rollout: int, num_nodes: int, gpus_per_node: int
) -> list[tuple[int, Placement]]:
    """(node index, placement) of every replica of the job, policy replicas first; a
    placement's devices are GPU ids on its node.

    The ranks and the layout's rules come from :func:`plan_placement` over all `num_nodes *
    gpus_per_node` GPUs; each replica then goes whole onto one node, the largest first, each on
    the first node with room (`mode = "colocated_separated"`: a rollout replica on its policy
    replica's node and GPUs). A replica larger than a node, or a layout that does not fit, is
    refused naming the keys and flags. On CPU (`gpus_per_node = 0`) the replicas take the nodes
    in turn (colocated rollout replicas: their policy replica's node)."""
    total = num_nodes * gpus_per_node
    try:
        plan = plan_placement(cfg, num_policy=num_policy, num_rollout=num_rollout, num_gpus=total)
    except ValueError as err:
        raise ValueError(f"{err} (--nodes {num_nodes} x --gpus-per-node {gpus_per_node})") from None
    colocated = cfg.mode == "colocated_separated"
    hosted = [p for p in plan if colocated and p.role == "rollout"]
    own = [p for p in plan if p not in hosted]
    placed: dict[str, tuple[int, Placement]] = {}
    if gpus_per_node == 0:
        for i, p in enumerate(own):
            placed[p.name] = (i % num_nodes, p)
    else:
        used = [0] * num_nodes
        for p in sorted(own, key=lambda p: -p.nproc):  # (stable: policy replicas first)
            if p.nproc > gpus_per_node:
                raise ValueError(
                    f"{p.name} needs {p.nproc} GPUs ({_keys(p.role)}) and a node has "
                    f"{gpus_per_node} (--gpus-per-node): a replica runs on one node"
                )
            node = next((n for n in range(num_nodes) if used[n] + p.nproc <= gpus_per_node), None)
            if node is None:
                sizes = ", ".join(f"{q.name} {q.nproc}" for q in own)
                raise ValueError(
                    f"the replicas ({sizes} GPUs: --policy/--rollout, policy.parallelism, "
                    f"rollout.parallelism) do not fit whole on {num_nodes} node(s) of "
                    f"{gpus_per_node} GPUs (--nodes, --gpus-per-node)"
                )
            devices = tuple(range(used[node], used[node] + p.nproc))
            used[node] += p.nproc
            placed[p.name] = (node, replace(p, devices=devices))
    by_name = {p.name: p for p in plan}
    for r in hosted:  # the same slice of its policy replica's GPUs that plan_placement chose
        host = by_name[f"policy-{r.index % num_policy}"]
        node, moved = placed[host.name]
        start = host.devices.index(r.devices[0]) if r.devices else 0
        placed[r.name] = (node, replace(r, devices=moved.devices[start : start + r.nproc]))
    return [placed[p.name] for p in plan]


def _devices(devices: tuple[int, ...]) -> str:
    return ",".join(map(str, devices))


def _header(job: SlurmJob, output_dir: Path) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.num_nodes}",
    ]
    lines += ["#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    for flag, value in (
        ("partition", job.partition),
        ("account", job.account),
        ("time", job.time),
    ):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines.append(f"#SBATCH --output={output_dir}/slurm-%j.log")
    return lines


def _layout_comment(placed: list[tuple[int, Placement]], num_nodes: int, gpus: int) -> list[str]:
    lines = [f"# Layout: {num_nodes} node(s) x {gpus} GPU(s) (`scontrol show hostnames` order)"]
    for node in range(num_nodes):
        here = [
            f"{p.name} ({p.nproc} rank(s)" + (f", GPUs {_devices(p.devices)})" if gpus else ")")
            for n, p in placed
            if n == node
        ]
        if node == 0:
            here.insert(0, "controller + Redis")
        lines.append(f"#   node {node}: " + ("; ".join(here) or "(idle)"))
    return lines


def _replica_lines(node: int, p: Placement) -> list[str]:
    where = f"node {node}" + (f", GPUs {_devices(p.devices)}" if p.devices else "")
    env = f"env CUDA_VISIBLE_DEVICES={_devices(p.devices)} " if p.devices else ""
    return [
        f"# {p.name}: {p.nproc} rank(s) on {where}",
        f'srun --nodes=1 --ntasks=1 --nodelist="${{NODES[{node}]}}" --overlap \\',
        f'    {env}"$PYTHON" -m nebula_rl.cli replica --role {p.role} --controller "$CONTROLLER" \\',
        f'    --name {p.name} --nproc {p.nproc} > "$LOGS/{p.name}.log" 2>&1 &',
        f"started {p.name} {p.role} $!",
    ]


def render_sbatch(cfg: Config, job: SlurmJob) -> str:
    """The sbatch script of `job` (see the module docstring); raises ValueError, naming the key
    or flag, for what it cannot run."""
    _check_job(cfg, job)
    num_policy = job.num_policy or cfg.policy.parallelism.n_init_replicas
    num_rollout = job.num_rollout or cfg.rollout.parallelism.n_init_replicas
    if cfg.mode == "colocated":  # (the policy replicas generate: docs/colocated.md)
        if job.num_rollout:
            raise ValueError(
                f'--rollout {job.num_rollout}: mode = "colocated" starts no rollout replicas'
            )
        num_rollout = 0
    placed = place_on_nodes(
        cfg,
        num_policy=num_policy,
        num_rollout=num_rollout,
        num_nodes=job.num_nodes,
        gpus_per_node=job.gpus_per_node,
    )
    workdir = job.workdir.resolve()
    output_dir = workdir / (job.output_dir or Path(cfg.train.output_dir))
    if re.search(r"\s", str(output_dir)):  # (in the #SBATCH --output line)
        raise ValueError(
            f"the output folder {str(output_dir)!r} (--output-dir, else train.output_dir) must "
            "not hold spaces: Slurm's --output line cannot quote them"
        )
    # An external Redis (a redis:// URL in the config) is the controller's to read; else the job
    # starts one on node 0, on the config's port (cosmos-rl's form, e.g. "12800") or a free one.
    start_redis = not cfg.redis.startswith(("redis://", "rediss://", "unix://"))
    redis_port = int(cfg.redis) if cfg.redis.isdigit() else 0
    settings = {
        "WORKDIR": str(workdir),
        "PYTHON": job.python,
        "CONFIG": str(workdir / job.config_path),
        "OUTPUT_DIR": str(output_dir),
        "RUN_NAME": cfg.train.timestamp,
        "NUM_NODES": str(job.num_nodes),
        "NUM_POLICY": str(num_policy),
        "NUM_ROLLOUT": str(num_rollout),
        "CONTROLLER_PORT": str(job.port or cfg.controller.port),
        "START_REDIS": "1" if start_redis else "0",
        "REDIS_PORT": str(redis_port),
    }
    lines = _header(job, output_dir)
    lines += [
        "#",
        f"# Written by `nebula-rl slurm` (nebula-rl {__version__}) for {settings['CONFIG']}.",
        *_layout_comment(placed, job.num_nodes, job.gpus_per_node),
        "#",
        "# The job's token and Redis password are made when the job starts; they reach the",
        f"# processes through the environment ({TOKEN_ENV}) and a private file, never a",
        "# command line or this file.",
        "",
        "set -u -o pipefail",
        "",
        "# --- What `nebula-rl slurm` chose (edit here, or render again) ---",
    ]
    lines += [f"{key}={shlex.quote(value)}" for key, value in settings.items()]
    lines += [_BODY_START.rstrip("\n"), ""]
    lines.append("# --- The replicas: one job step each, on its node ---")
    for node, p in placed:
        lines += [*_replica_lines(node, p), ""]
    lines.append(_BODY_END.strip("\n"))
    return "\n".join(lines) + "\n"


_BODY_START = r"""
cd "$WORKDIR" || exit 2
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # (as `nebula-rl train` sets them)
log() { echo "[$(date +%T)] nebula-rl slurm: $*"; }
fail() { echo "[$(date +%T)] nebula-rl slurm: error: $1" >&2; exit "${2:-1}"; }  # MESSAGE [CODE]
# Small helpers in Python (the same interpreter the job runs): nothing more to install.
secret() { "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))'; }
free_port() {
    "$PYTHON" -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' "$1"
}

# --- Nodes: the controller and Redis on node 0, where Slurm runs this script ---
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#NODES[@]} >= NUM_NODES )) || fail "the allocation has ${#NODES[@]} node(s), the layout needs $NUM_NODES" 2
# The address the other nodes reach node 0 at: NEBULA_HEAD_ADDR if set at submission, else
# what node 0's name resolves to (bound by Redis and the controller: not loopback).
HEAD_ADDR=${NEBULA_HEAD_ADDR:-}
if [[ -z $HEAD_ADDR ]]; then
    HEAD_ADDR=$("$PYTHON" -c 'import socket, sys; print(socket.gethostbyname(sys.argv[1]))' "${NODES[0]}") \
        || fail "cannot resolve ${NODES[0]}: set NEBULA_HEAD_ADDR to its address" 2
    if [[ $HEAD_ADDR == 127.* ]] && (( NUM_NODES > 1 )); then
        fail "${NODES[0]} resolves to $HEAD_ADDR (loopback), which the other nodes cannot reach: set NEBULA_HEAD_ADDR to its address" 2
    fi
fi
RUN_DIR="$OUTPUT_DIR/${RUN_NAME:-slurm-${SLURM_JOB_ID:-0}}"
LOGS="$RUN_DIR/logs"
mkdir -p "$LOGS" || exit 2
log "job ${SLURM_JOB_ID:-?}: nodes ${NODES[*]:0:NUM_NODES}; node 0 at $HEAD_ADDR; run folder $RUN_DIR"

# --- Stopping: replicas first, then the controller, then Redis (which flushes its file) ---
REPLICA_PIDS=() REPLICA_NAMES=() REPLICA_ROLES=()
CONTROLLER_PID="" REDIS_PID="" JOB_OK=0
started() { REPLICA_NAMES+=("$1"); REPLICA_ROLES+=("$2"); REPLICA_PIDS+=("$3"); }
alive() { local pid; for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
stop() {  # SIGTERM to the processes given, SIGKILL to those still there 15 s later
    local pid waited=0
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null; done
    while alive "$@" && (( waited < 150 )); do sleep 0.1; waited=$((waited + 1)); done
    for pid in "$@"; do kill -KILL "$pid" 2>/dev/null; done
}
cleanup() {
    trap - EXIT INT TERM
    local waited=0
    # After a job that ended well, the replicas leave on their own: give them 15 s.
    while (( JOB_OK )) && (( ${#REPLICA_PIDS[@]} )) && alive "${REPLICA_PIDS[@]}" && (( waited < 150 )); do
        sleep 0.1; waited=$((waited + 1))
    done
    (( ${#REPLICA_PIDS[@]} )) && stop "${REPLICA_PIDS[@]}"
    [[ -n $CONTROLLER_PID ]] && stop "$CONTROLLER_PID"
    [[ -n $REDIS_PID ]] && stop "$REDIS_PID"
    wait 2>/dev/null
}
trap cleanup EXIT
trap 'log "SIGTERM: stopping the job"; exit 143' TERM
trap 'log "SIGINT: stopping the job"; exit 130' INT

# --- Before anything starts: the warm-start model and the checks `nebula-rl train` makes ---
"$PYTHON" -m nebula_rl.launch.slurm prepare "$CONFIG" || fail "the job cannot start (see above)" 2

# --- Secrets, made here: environment and private files only ---
export NEBULA_TOKEN
NEBULA_TOKEN=$(secret) || fail "cannot make the job's token"
(umask 077 && printf '%s\n' "$NEBULA_TOKEN" > "$RUN_DIR/token")  # for `nebula-rl status --run-dir`
REDIS_URL=""  # empty: the controller uses the config's `redis` URL
if (( START_REDIS )); then
    REDIS_DIR="$RUN_DIR/redis"
    mkdir -p -m 700 "$REDIS_DIR" || exit 1
    REDIS_PASSWORD=$(secret) || fail "cannot make the Redis password"
    (( REDIS_PORT )) || REDIS_PORT=$(free_port "$HEAD_ADDR") || fail "no free port on $HEAD_ADDR"
    # The settings of nebula_rl.controller.redis_server, bound to node 0's address: the
    # replicas on other nodes meet in this Redis (the controller hands them its URL).
    (umask 077 && cat > "$REDIS_DIR/redis.conf" <<EOF
bind $HEAD_ADDR
port $REDIS_PORT
requirepass "$REDIS_PASSWORD"
protected-mode yes
dir "$REDIS_DIR"
logfile "$REDIS_DIR/redis.log"
daemonize no
appendonly yes
appendfsync everysec
save ""
EOF
    ) || fail "cannot write $REDIS_DIR/redis.conf"
    REDIS_BIN=$("$PYTHON" -c 'from nebula_rl.controller.redis_server import redis_executable as r; print(r())') \
        || fail "no redis-server (nebula_rl.controller.redis_server.redis_executable)"
    "$REDIS_BIN" "$REDIS_DIR/redis.conf" > /dev/null 2>&1 &
    REDIS_PID=$!
    REDIS_URL="redis://:$REDIS_PASSWORD@$HEAD_ADDR:$REDIS_PORT/0"
    NEBULA_REDIS_URL=$REDIS_URL "$PYTHON" -c '
import os, sys, time, redis
client = redis.Redis.from_url(os.environ["NEBULA_REDIS_URL"], socket_connect_timeout=1.0)
for _ in range(150):
    try:
        sys.exit(0 if client.ping() else 1)
    except (redis.ConnectionError, redis.BusyLoadingError):
        time.sleep(0.1)
sys.exit(1)' || fail "Redis did not answer on $HEAD_ADDR:$REDIS_PORT (see $REDIS_DIR/redis.log)"
    log "Redis on $HEAD_ADDR:$REDIS_PORT"
fi

# --- The controller, on node 0's address ---
(( CONTROLLER_PORT )) || CONTROLLER_PORT=$(free_port "$HEAD_ADDR") || fail "no free port on $HEAD_ADDR"
CONTROLLER="$HEAD_ADDR:$CONTROLLER_PORT"
NEBULA_REDIS_URL=$REDIS_URL PYTHONUNBUFFERED=1 "$PYTHON" -m nebula_rl.cli controller \
    --config "$CONFIG" --run-dir "$RUN_DIR" --host "$HEAD_ADDR" --port "$CONTROLLER_PORT" \
    --policy "$NUM_POLICY" --rollout "$NUM_ROLLOUT" > "$LOGS/controller.log" 2>&1 &
CONTROLLER_PID=$!
for (( i = 0; ; i++ )); do  # up to 120 s for /health
    alive "$CONTROLLER_PID" || fail "the controller exited while starting; see $LOGS/controller.log"
    "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://$CONTROLLER/health" 2>/dev/null && break
    (( i < 120 )) || fail "the controller did not answer on $CONTROLLER within 120 s"
    sleep 1
done
log "controller at $CONTROLLER (log $LOGS/controller.log)"
"""

_BODY_END = r"""
# --- Until the controller ends: its exit code is the job's ---
# A replica that fails is left out (the controller re-issues its work); the job ends when every
# replica of a role has failed. (`sleep & wait`: a signal is handled at once.)
declare -A EXITED=()
while alive "$CONTROLLER_PID"; do
    for i in "${!REPLICA_PIDS[@]}"; do
        name=${REPLICA_NAMES[i]}
        if [[ -z ${EXITED[$name]:-} ]] && ! alive "${REPLICA_PIDS[i]}"; then
            wait "${REPLICA_PIDS[i]}"; EXITED[$name]=$?
            log "$name exited with ${EXITED[$name]} (log $LOGS/$name.log)"
        fi
    done
    for role in policy rollout; do
        left=0
        for i in "${!REPLICA_PIDS[@]}"; do
            [[ ${REPLICA_ROLES[i]} == "$role" && ${EXITED[${REPLICA_NAMES[i]}]:-0} == 0 ]] && left=1
        done
        (( left )) || fail "no $role replica is left: ending the job"
    done
    sleep 2 & wait $!
done
wait "$CONTROLLER_PID"
CODE=$?
if (( CODE == 0 )); then
    JOB_OK=1
    log "job finished: $RUN_DIR"
else
    log "the controller failed (exit $CODE); see $LOGS/controller.log"
fi
exit "$CODE"
"""


def submit(script: Path) -> str:
    """Submit `script` with `sbatch`; the job id."""
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"sbatch {script} failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    # --parsable prints `<job id>[;<cluster>]`
    return done.stdout.strip().split(";")[0]


def prepare(config_path: str) -> int:
    """In the job, before anything starts: what `nebula-rl train` does first (the loggers it
    needs, the warm-start model, the checks of :func:`nebula_rl.launch.check_job`); the exit
    code (2 with the error for what the config gets wrong)."""
    from nebula_rl.config import ConfigError, load_config
    from nebula_rl.launch import check_job, ensure_model
    from nebula_rl.utils.metrics_log import check_installed

    try:
        cfg = load_config(config_path)
        check_installed(cfg.logging.logger)
        ensure_model(cfg)
        check_job(cfg)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if (
    __name__ == "__main__"
):  # `python -m nebula_rl.launch.slurm prepare CONFIG` (the script's first step)
    if sys.argv[1:2] != ["prepare"] or len(sys.argv) != 3:
        print("usage: python -m nebula_rl.launch.slurm prepare CONFIG", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(prepare(sys.argv[2]))
