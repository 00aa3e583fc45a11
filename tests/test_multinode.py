"""Multi-node on one machine: every node is a Linux network namespace, the namespaces joined by
veth pairs on a bridge, and the job's processes are started on their nodes by hand, as a user
would start them on a cluster (docs/multinode.md):

- node0: the job's Redis (bound to node0's address, with a password) and `nebula-rl controller
  --host <node0's address>`;
- node1: `nebula-rl replica --role policy --controller <node0>:PORT`;
- node2 (and node3): `nebula-rl replica --role rollout --controller <node0>:PORT`.

A node namespace has only loopback and its veth, so whatever the processes of two nodes say to
each other crosses the bridge: the controller's HTTP API, Redis, and the gloo groups between the
replicas. Each node also gets a `/dev/shm` of its own (a tmpfs mounted in the private mount
namespace `ip netns exec` makes), as separate hosts have: the policy cannot hand the weights to
the rollouts through shared memory and sends them over gloo.

The bridge lives in a namespace of its own ("hub"), so nothing is added to the machine's own
network namespace: no interface, no address, no route, and no firewall of the host's sees the
traffic. A link is cut with `ip link set ... down` on the hub's end of a node's veth.

Root and `ip` (iproute2) are needed; the tests are skipped without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nebula_rl.config import Config
from nebula_rl.controller.client import REDIS_URL_ENV, TOKEN_ENV
from nebula_rl.controller.redis_server import redis_executable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="network namespaces need root and iproute2's `ip`",
    ),
]

BATCH = 4
CONTROLLER_PORT = 8000
REDIS_PORT = 6379
JOB_TIMEOUT_S = 150.0
JOB = "multinode"
"""The run folder's name, also the job's name in Redis."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _free_subnet() -> str:
    """A `10.213.N` /24 that no interface of this machine uses (the nodes' addresses never leave
    their namespaces; this keeps them apart from the host's anyway)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for n in range(10, 250):
        if f" 10.213.{n}." not in used:
            return f"10.213.{n}"
    raise RuntimeError("no free 10.213.N.0/24")


@dataclass
class Cluster:
    """Nodes (network namespaces) on one bridge, and the processes started on them."""

    tag: str
    """Prefix of this cluster's namespace names."""
    subnet: str
    """The nodes' /24, as `10.213.N`."""
    logs: Path
    nodes: dict[str, str] = field(default_factory=dict)
    """Node name -> its address."""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def create(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")

    def add_node(self, node: str) -> str:
        """A namespace `node` whose `eth0` is one end of a veth pair, the other end (`v-<node>`)
        on the hub's bridge; its address."""
        ns, address = self.ns(node), f"{self.subnet}.{len(self.nodes) + 2}"
        _ip("netns", "add", ns)
        self.nodes[node] = address
        _ip("-n", self.hub, "link", "add", f"v-{node}", "type", "veth", "peer", "name", "eth0")
        _ip("-n", self.hub, "link", "set", "eth0", "netns", ns)
        _ip("-n", self.hub, "link", "set", f"v-{node}", "master", "br0")
        _ip("-n", self.hub, "link", "set", f"v-{node}", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return address

    def cut(self, node: str) -> None:
        """Take `node` off the network: its link to the bridge goes down."""
        _ip("-n", self.hub, "link", "set", f"v-{node}", "down")

    def start(
        self, node: str, name: str, argv: list[str], env: dict[str, str], disk: Path | None = None
    ) -> None:
        """Run `argv` on `node` (in its own session, logging to `<logs>/<name>.log`), with a
        private `/dev/shm` and, for `disk` (a folder), an empty one of its own there (as a node
        that does not share that file system)."""
        log = (self.logs / f"{name}.log").open("ab")
        wrapped = ["ip", "netns", "exec", self.ns(node), "sh", "-c"]
        mounts = "mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm && "
        if disk is not None:
            mounts += f"mount -t tmpfs -o size=2g tmpfs {shlex.quote(str(disk))} && "
        wrapped += [mounts + 'exec "$@"', "sh"]
        self.processes[name] = subprocess.Popen(
            wrapped + argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def on(self, node: str, code: str, env: dict[str, str], *, timeout_s: float = 60.0) -> str:
        """Run the Python `code` on `node`; what it printed."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns(node), sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def watch(self, node: str, code: str, env: dict[str, str]) -> subprocess.Popen[str]:
        """Run the Python `code` on `node` (stopped with the others), talking to it through its
        stdin and stdout."""
        watcher = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(node), sys.executable, "-c", code],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.processes[f"watcher-{watcher.pid}"] = watcher  # type: ignore[assignment]
        return watcher

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to process `name`'s process group."""
        _signal_group(self.processes[name], sig)

    def in_namespace(self, name: str) -> bool:
        """Whether process `name` runs in the network namespace of the node it was started on."""
        pid = self.processes[name].pid
        found = subprocess.run(
            ["ip", "netns", "identify", str(pid)], capture_output=True, text=True
        )
        return found.stdout.strip() != "" and found.stdout.strip().startswith(self.tag)

    def stop(self) -> None:
        """Stop every process (their whole process groups), then remove the namespaces (with
        them their veths and the bridge)."""
        for process in self.processes.values():
            if process.poll() is None:
                _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
            _signal_group(process, signal.SIGKILL)  # (also what its children left behind)
            process.wait()
        for ns in [*map(self.ns, self.nodes), self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def tail(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted(self.logs.glob("*.log"))
        )


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    logs = tmp_path / "logs"
    logs.mkdir()
    net = Cluster(f"nrl{os.getpid()}{secrets.token_hex(2)}", _free_subnet(), logs)
    try:
        net.create()
        yield net
    finally:
        net.stop()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert net.tag not in left, left


def _start_job(
    cluster: Cluster,
    tmp_path: Path,
    cfg: Config,
    *,
    policy: list[str],
    rollout: list[str],
    counts: tuple[int, int] | None = None,
) -> dict[str, str]:
    """Redis and the controller on node0 (told to expect `counts` policy and rollout replicas,
    default as many as started), then a policy replica on each node of `policy` and a rollout
    replica on each of `rollout` (named `policy-<i>` / `rollout-<i>`), started by hand; the
    environment a process of the job gets (the token, and on node0 the Redis URL)."""
    cluster.add_node("node0")
    for node in [*policy, *rollout]:
        cluster.add_node(node)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env, head_env = _start_redis(cluster, tmp_path, base)
    _start_controller(cluster, tmp_path, cfg, head_env, counts or (len(policy), len(rollout)))
    for role, nodes in (("policy", policy), ("rollout", rollout)):
        for i, node in enumerate(nodes):
            _start_replica(cluster, node, role, f"{role}-{i}", env)
    return head_env


def _start_redis(
    cluster: Cluster, tmp_path: Path, base: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """The job's Redis, as a user starts one: on node0's address, with a password, once it
    answers; the environment of the job's processes (`base` and the job's token) and that of
    node0's (with the Redis URL too)."""
    head = cluster.nodes["node0"]
    password = secrets.token_urlsafe(24)
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir(mode=0o700)
    conf = redis_dir / "redis.conf"
    conf.write_text(
        f"bind {head}\nport {REDIS_PORT}\nrequirepass {password}\nprotected-mode yes\n"
        f'dir "{redis_dir}"\nsave ""\nappendonly no\n'
    )
    conf.chmod(0o600)
    cluster.start("node0", "redis", [redis_executable(), str(conf)], base)
    env = {**base, TOKEN_ENV: secrets.token_urlsafe(32)}
    head_env = {**env, REDIS_URL_ENV: f"redis://:{password}@{head}:{REDIS_PORT}/0"}
    cluster.on(
        "node0",
        "import os, time, redis\n"
        f"r = redis.Redis.from_url(os.environ[{REDIS_URL_ENV!r}])\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        r.ping(); break\n"
        "    except redis.ConnectionError:\n"
        "        time.sleep(0.1)\n",
        head_env,
    )
    return env, head_env


def _start_controller(
    cluster: Cluster, tmp_path: Path, cfg: Config, env: dict[str, str], counts: tuple[int, int]
) -> None:
    """`nebula-rl controller` on node0 (`counts` policy and rollout replicas), once it answers."""
    head = cluster.nodes["node0"]
    config = tmp_path / "job.json"
    config.write_text(cfg.model_dump_json())
    run_dir = Path(cfg.train.output_dir) / cfg.train.timestamp
    cli = [sys.executable, "-m", "nebula_rl.cli"]
    controller = [*cli, "controller", "--config", str(config), "--run-dir", str(run_dir)]
    controller += ["--host", head, "--port", str(CONTROLLER_PORT)]
    controller += ["--policy", str(counts[0]), "--rollout", str(counts[1])]
    cluster.start("node0", "controller", controller, env)
    cluster.on("node0", _HEALTHY.replace("{head}", head), env, timeout_s=90)


def _start_replica(
    cluster: Cluster,
    node: str,
    role: str,
    name: str,
    env: dict[str, str],
    disk: Path | None = None,
) -> None:
    """`nebula-rl replica` on `node`, reaching the controller on node0 (`disk`: a folder that
    node does not share, `Cluster.start`)."""
    address = f"{cluster.nodes['node0']}:{CONTROLLER_PORT}"
    argv = [sys.executable, "-m", "nebula_rl.cli", "replica", "--role", role]
    argv += ["--controller", address, "--name", name, "--nproc", "1"]
    env = {k: v for k, v in env.items() if k != REDIS_URL_ENV}
    cluster.start(node, name, argv, env, disk=disk)


def _cfg(
    grpo_job_config: Callable[..., Config], head: str, *, num_rows: int, **ctl: float
) -> Config:
    return grpo_job_config(
        {"controller": {"host": head, "port": CONTROLLER_PORT, **ctl}},
        timestamp=JOB,
        num_rows=num_rows,
        groups=BATCH,
    )


_HEALTHY = f"""
import time, httpx
while True:  # (as the Slurm script does: replicas start once the controller answers)
    try:
        if httpx.get("http://{{head}}:{CONTROLLER_PORT}/health").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.2)
"""


_PEEK = f"""
import json, os, httpx, redis
from nebula_rl.controller import JobState
r = redis.Redis.from_url(os.environ[{REDIS_URL_ENV!r}], decode_responses=True)
clients = sorted({{c["addr"].rsplit(":", 1)[0] for c in r.client_list()}})
prompts = JobState(r, "{{job}}").key("prompts")
held = {{
    name: len(r.xpending_range(prompts, "rollout", "-", "+", 100, name))
    for name in ("rollout-0", "rollout-1")
}} if r.exists(prompts) else {{}}
answer = httpx.get(
    "http://{{head}}:{CONTROLLER_PORT}/api/replicas",
    headers={{"Authorization": "Bearer " + os.environ[{TOKEN_ENV!r}]}},
)
print(json.dumps({{"clients": clients, "held": held, "replicas": answer.json()["replicas"]}}))
"""


_WATCH = f"""
import os, time, redis
from nebula_rl.controller import JobState
r = redis.Redis.from_url(os.environ[{REDIS_URL_ENV!r}], decode_responses=True)
state = JobState(r, "{{job}}")
prompts = state.key("prompts")


def held():
    return len(r.xpending_range(prompts, "rollout", "-", "+", 100, "rollout-1"))


while True:
    while not held():
        if state.finished() is not None:
            raise SystemExit("the job finished before rollout-1 held prompts")
        time.sleep(0.005)
    print("holds", flush=True)
    input()  # (the test froze rollout-1)
    count = held()
    print(count, flush=True)
    if count:
        break
    input()  # (the test let it go on)
"""


def _peek(cluster: Cluster, env: dict[str, str]) -> dict:
    """From node0: the addresses of Redis's clients, the prompts each rollout replica holds
    (claimed, not acknowledged), the controller's replica registry."""
    code = _PEEK.replace("{head}", cluster.nodes["node0"]).replace("{job}", JOB)
    return json.loads(cluster.on("node0", code, env))


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if "policy_version" in r]


def _wait(cluster: Cluster, what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if cluster.processes["controller"].poll() is not None:
            pytest.fail(f"the controller ended before {what}:\n{cluster.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:.0f} s:\n{cluster.tail()}")
        time.sleep(0.2)


def _finish(cluster: Cluster, names: list[str]) -> None:
    """Wait for the processes `names` (the controller first) to exit with 0."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for name in names:
        try:
            code = cluster.processes[name].wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish:\n{cluster.tail()}")
        assert code == 0, f"{name} exited with {code}:\n{cluster.tail()}"


def _check_ledger(run_dir: Path, num_rows: int) -> dict:
    """Every prompt of the epoch trained exactly once; the ledger."""
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert list(ledger) == ["0"]
    assert ledger["0"]["trained"] == {str(i): 1 for i in range(num_rows)}
    summary = ledger["0"]["summary"]
    assert summary["trained"] == num_rows and summary["trained_more_than_once"] == 0
    return ledger


def test_job_across_three_nodes(cluster, tmp_path, grpo_job_config):
    """Controller and Redis on node0, the policy on node1, the rollout on node2: the job runs to
    its end, every prompt is trained once, and the weights went from node1 to node2 over gloo."""
    num_rows = 64  # (steps enough that the job still runs while the test looks at it)
    cfg = _cfg(grpo_job_config, f"{cluster.subnet}.2", num_rows=num_rows)
    run_dir = Path(cfg.train.output_dir) / cfg.train.timestamp
    env = _start_job(cluster, tmp_path, cfg, policy=["node1"], rollout=["node2"])
    node0, node1, node2 = (cluster.nodes[n] for n in ("node0", "node1", "node2"))
    assert cfg.controller.host == node0
    _wait(cluster, "step 2", lambda: len(_steps(run_dir)) >= 2, JOB_TIMEOUT_S)
    # While the job runs: each process is in its node's namespace, the replicas' Redis
    # connections come from their nodes' addresses, and the controller knows both replicas.
    for name in ("controller", "redis", "policy-0", "rollout-0"):
        assert cluster.in_namespace(name), name
    seen = _peek(cluster, env)
    assert {node1, node2} <= set(seen["clients"]), seen["clients"]
    assert set(seen["clients"]) <= {node0, node1, node2}, seen["clients"]
    assert {r["name"] for r in seen["replicas"]} == {"policy-0", "rollout-0"}
    _finish(cluster, ["controller", "policy-0", "rollout-0"])

    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == list(range(1, num_rows // BATCH + 1))
    assert [m["policy_version"] for m in steps] == [m["step"] for m in steps]
    assert all(m["num_tokens"] > 0 and isinstance(m["reward_mean"], float) for m in steps)
    _check_ledger(run_dir, num_rows)
    assert (run_dir / "safetensors" / "final").is_dir()  # (node1 exported it)
    policy_log = (cluster.logs / "policy-0.log").read_text()
    # The weight group spans node1 and node2: no shared memory between them, so over gloo.
    sending = re.findall(r"sending to 1 rollout replica\(s\) \(1 processes\) over (.*)", policy_log)
    assert sending and all(s.strip() == "gloo" for s in sending), sending
    rollout_log = (cluster.logs / "rollout-0.log").read_text()
    # (the last step's weights are exported, not pushed: no prompt is left to generate)
    assert f"weights of version {len(steps) - 1} in place" in rollout_log


def test_rollout_node_cut_off_mid_run(cluster, tmp_path, grpo_job_config):
    """Two rollout nodes; after step 2 node3's link goes down (the process lives on, unreachable):
    the controller declares rollout-1 dead, requeues its prompts and rebuilds the weight group
    without it, and the job finishes on node2 with every prompt trained exactly once."""
    num_rows = 96  # (enough steps that the watcher, started once rollout-1 works, sees it hold)
    cfg = _cfg(
        grpo_job_config,
        f"{cluster.subnet}.2",
        num_rows=num_rows,
        heartbeat_timeout=4.0,
        collective_timeout=15.0,
    )
    cfg.rollout.max_response_length = 8  # (longer generations: replicas hold prompts longer)
    run_dir = Path(cfg.train.output_dir) / cfg.train.timestamp
    env = _start_job(cluster, tmp_path, cfg, policy=["node1"], rollout=["node2", "node3"])
    node3 = cluster.nodes["node3"]

    rollout_1 = cluster.logs / "rollout-1.log"

    def rollout_1_works() -> bool:  # (it took weights: it is in the weight group)
        return "in place" in rollout_1.read_text(errors="replace")

    _wait(cluster, "rollout-1 in the weight group", rollout_1_works, JOB_TIMEOUT_S)
    assert node3 in _peek(cluster, env)["clients"]
    # Cut node3 off while rollout-1 holds prompts: a watcher on node0 polls Redis every 5 ms;
    # when rollout-1 holds some, the test freezes it (SIGSTOP) and the watcher counts them again
    # (it may have acknowledged them meanwhile: then it goes on and the watch starts again).
    watcher = cluster.watch("node0", _WATCH.replace("{job}", JOB), env)
    held = 0
    while not held:
        line = watcher.stdout.readline()
        assert line == "holds\n", f"{line}{watcher.communicate()}\n{cluster.tail()}"
        cluster.signal("rollout-1", signal.SIGSTOP)
        watcher.stdin.write("\n")
        watcher.stdin.flush()
        held = int(watcher.stdout.readline())
        if not held:
            cluster.signal("rollout-1", signal.SIGCONT)
            watcher.stdin.write("\n")
            watcher.stdin.flush()
    assert watcher.wait(timeout=30) == 0
    cluster.cut("node3")
    cluster.signal("rollout-1", signal.SIGCONT)  # (it goes on, cut off, holding its prompts)
    cut_at = len(_steps(run_dir))
    _finish(cluster, ["controller", "policy-0", "rollout-0"])
    # (cut off, rollout-1 fails once a Redis read times out, or still waits: never a clean exit)
    assert cluster.processes["rollout-1"].poll() != 0

    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == list(range(1, num_rows // BATCH + 1))
    assert cut_at < len(steps)
    ledger = _check_ledger(run_dir, num_rows)
    controller_log = (cluster.logs / "controller.log").read_text()
    assert "replica rollout-1 missed heartbeats" in controller_log
    # The weight group was rebuilt without node3: its last generation sends to rollout-0 only.
    policy_log = (cluster.logs / "policy-0.log").read_text()
    assert "sending to 2 rollout replica(s)" in policy_log
    assert policy_log.rfind("sending to 1 rollout replica(s)") > policy_log.rfind(
        "sending to 2 rollout replica(s)"
    )
    assert held > 0 and ledger["0"]["summary"]["requeue_events"] >= held


_BUFFERED = f"""
import os, time, redis
from nebula_rl.controller import JobState
state = JobState(redis.Redis.from_url(os.environ[{REDIS_URL_ENV!r}], decode_responses=True), "{JOB}")
while state.buffer_size() < {{n}}:
    time.sleep(0.1)
"""


def test_world_model_job_across_nodes(cluster, tmp_path):
    """World-model RL across nodes that share no trajectory folder (each its own /dev/shm).
    rollout-0 (node3) starts alone and samples the first batches; it is killed before any policy
    replica exists, and its trajectories go with it. Then rollout-1 (node2) and the policy
    (node1) start: the policy hands the steps of rollout-0's groups back, their prompts are
    sampled again, and it trains on rollout-1's trajectories, fetched from node2 over gloo.
    Every prompt is trained exactly once."""
    from nebula_rl.config import config_from_dict
    from test_flow_runtime import NUM_ROWS, PROMPTS_PER_STEP, _job

    head = f"{cluster.subnet}.2"
    raw = _job(tmp_path, **{"controller.host": head, "controller.port": CONTROLLER_PORT})
    raw["train"]["timestamp"] = JOB
    cfg = config_from_dict(raw)
    run_dir = Path(cfg.train.output_dir) / JOB
    env = _start_job(cluster, tmp_path, cfg, policy=[], rollout=["node3"], counts=(1, 2))
    for node in ("node1", "node2"):
        cluster.add_node(node)
    code = _BUFFERED.replace("{n}", str(PROMPTS_PER_STEP))
    cluster.on("node0", code, env, timeout_s=JOB_TIMEOUT_S)
    cluster.signal("rollout-0", signal.SIGKILL)
    _start_replica(cluster, "node2", "rollout", "rollout-1", env)
    _start_replica(cluster, "node1", "policy", "policy-0", env)
    _finish(cluster, ["controller", "policy-0", "rollout-1"])

    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == list(range(1, NUM_ROWS // PROMPTS_PER_STEP + 1))
    ledger = _check_ledger(run_dir, NUM_ROWS)
    assert ledger["0"]["summary"]["trajectories_lost"] >= PROMPTS_PER_STEP
    policy_log = (cluster.logs / "policy-0.log").read_text()
    assert "handing it back" in policy_log
    fetched = [
        int(n) for n in re.findall(r"fetched (\d+) trajector(?:y|ies) from rollout-1", policy_log)
    ]
    assert sum(fetched) >= NUM_ROWS, policy_log[-3000:]  # (a step handed back: again)
    assert "from rollout-0" not in policy_log.replace("not fetched", "")
    controller_log = (cluster.logs / "controller.log").read_text()
    assert "handed back untrained" in controller_log


_STORE = """
import json, sys
from nebula_rl.utils.object_store import ObjectStore
store = ObjectStore("{bucket}", "nodes")
for _ in range(180):  # (until the gateway answers)
    try:
        store._client.create_bucket(Bucket="{bucket}")
        break
    except Exception as err:
        if "BucketAlready" in str(err):
            break
        import time; time.sleep(0.5)
{action}
"""


def test_a_job_whose_nodes_share_no_disk_uploads_and_resumes_through_the_store(
    cluster, tmp_path, grpo_job_config
):
    """S3 (SeaweedFS) on node0; the policy on node1 writes its checkpoints on a disk of its own
    (an empty file system over the output folder), the controller on node0 its snapshots and
    metrics: each uploads its part. Then the job is started again into a fresh output folder,
    after its step-6 checkpoint was lost: the controller fetches the step-4 checkpoint and its
    snapshot, node1 (an empty disk again) downloads the checkpoint it is told to resume from,
    and the job ends with every prompt trained once across the two runs."""
    from test_storage import BUCKET, _env, _Weed

    head = cluster.add_node("node0")
    for node in ("node1", "node2"):
        cluster.add_node(node)
    weed = _Weed(tmp_path / "weed", ip=head)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    cluster.start("node0", "weed", weed.argv(), base)
    s3 = {**base, **_env(weed.endpoint)}

    def store(action: str) -> str:
        code = _STORE.replace("{bucket}", BUCKET).replace("{action}", action)
        return cluster.on("node0", code, s3, timeout_s=120)

    store("")
    upload = {"upload_s3": "all", "s3_bucket": BUCKET, "s3_prefix": "nodes", "max_keep": -1}
    ckpt = {"enable_checkpoint": True, "save_freq": 2, **upload}
    cfg = grpo_job_config(
        {"controller": {"host": head, "port": CONTROLLER_PORT}, "train": {"ckpt": ckpt}},
        timestamp=JOB,
        num_rows=24,
        groups=BATCH,
        allowed=0,
    )
    output = Path(cfg.train.output_dir)
    output.mkdir(parents=True)
    run_dir = output / JOB
    env, head_env = _start_redis(cluster, tmp_path, s3)
    _start_controller(cluster, tmp_path, cfg, head_env, (1, 1))
    _start_replica(cluster, "node1", "policy", "policy-0", env, disk=output)
    _start_replica(cluster, "node2", "rollout", "rollout-0", env)
    _finish(cluster, ["controller", "policy-0", "rollout-0"])
    first = _steps(run_dir)
    assert [m["step"] for m in first] == [1, 2, 3, 4, 5, 6]
    assert not (run_dir / "checkpoints" / "step_2").exists()  # (on node1's disk, gone with it)
    listed = json.loads(store(f"print(json.dumps(store.committed({JOB!r})))"))
    kinds = ("checkpoints", "checkpoints/controller", "safetensors")
    assert listed == sorted(f"{JOB}/{k}/step_{s}" for k in kinds for s in (2, 4, 6))

    # Started again into a fresh output folder, after step 6's checkpoint was lost.
    store(f"store.delete_folder('{JOB}/checkpoints/step_6')")
    for name in ("controller", "policy-0", "rollout-0"):
        (cluster.logs / f"{name}.log").rename(cluster.logs / f"{name}.first")
    cfg.train.output_dir, cfg.train.resume = str(tmp_path / "fresh"), True
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _start_controller(cluster, tmp_path, cfg, head_env, (1, 1))
    _start_replica(cluster, "node1", "policy", "policy-0", env, disk=fresh)
    _start_replica(cluster, "node2", "rollout", "rollout-0", env)
    _finish(cluster, ["controller", "policy-0", "rollout-0"])
    policy_log = (cluster.logs / "policy-0.log").read_text()
    assert f"downloaded the checkpoint {JOB}/checkpoints/step_4" in policy_log
    assert "resumed the job at step 4" in (cluster.logs / "controller.log").read_text()
    again = _steps(fresh / JOB)
    assert [m["step"] for m in again] == [1, 2, 3, 4, 5, 6]
    assert again[:4] == first[:4]  # (fetched with the checkpoint, not trained again)
    _check_ledger(fresh / JOB, 24)
    listed = json.loads(store(f"print(json.dumps(store.committed({JOB!r})))"))
    assert f"{JOB}/checkpoints/step_6" in listed  # (uploaded again, from node1)
