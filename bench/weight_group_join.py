"""Stress of the weight group's joins: a second rollout replica joins while generation 1 is
being built (docs/weight-sync.md, "Replicas joining and leaving").

    python bench/weight_group_join.py --trials 40 [--timeout 20] [--seed 1]

One Redis (the project's `start_redis`). Each trial starts fresh processes (an ElasticSender
"policy-0" looping as `policy/worker.py` does: read the published generation, wait up to 0.5 s
for commands, refresh to what it read, push; and two ElasticReceivers "rollout-0"/"rollout-1"),
publishes generation 1 = [policy-0, rollout-0], then after a random delay (0 to `--max-delay`
s) generation 2 = [policy-0, rollout-0, rollout-1], and answers regroup requests as the
controller does. It measures the time from generation 2 to both receivers holding a push of
generation >= 2. A trial past 4 s gets every process's thread stacks dumped (faulthandler on
SIGUSR1) into the work folder's logs. The summary line counts the trials that waited about the
collective timeout (`--timeout`). See BENCHMARKS.md: 5 of 20 before joins were settled once for
all members, 0 of 20 after (2 CPU cores, 2026-11-28).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

LOGS = Path(tempfile.gettempdir()) / "nebula-weight-group-join"


def child(role: str, url: str, job: str, timeout_s: float, mode: str, logfile: str) -> None:
    import torch

    torch.set_num_threads(1)
    from nebula_rl.controller import JobState, connect
    from nebula_rl.weights.elastic import ElasticReceiver, ElasticSender, current_generation
    from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender, full_box

    log_f = open(logfile, "a", buffering=1)  # noqa: SIM115 (the process's log until it exits)
    faulthandler.register(signal.SIGUSR1, file=log_f, all_threads=True)
    logging.basicConfig(
        stream=log_f,
        level=logging.INFO,
        format=f"%(asctime)s.%(msecs)03d {role} %(threadName)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    say = logging.getLogger("stress").info
    state = JobState(connect(url), job)
    timeout = timedelta(seconds=timeout_s)
    stop = lambda: state.redis.exists(f"stress:{job}:stop")  # noqa: E731

    def tensors(version: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(version)
        return {
            "w": torch.randn(64, 64, generator=g).requires_grad_(True),
            "b": torch.randn(64, generator=g).requires_grad_(True),
        }

    state.redis.set(f"stress:{job}:ready:{role}", 1)
    if role == "policy-0":
        sender = ElasticSender(
            state,
            role,
            make_sender=lambda group, n: ShardedSender(group, tensors(0), num_senders=n),
            timeout=timeout,
        )
        version = 0
        while not stop():
            t = time.monotonic()
            if mode == "tick":
                gen = current_generation(state)
                time.sleep(0.5)  # read_commands(block_ms=500) with no command
                sender.refresh(lambda v=version: tensors(v), version, generation=gen)
            else:
                sender.refresh(lambda v=version: tensors(v), version)
            dt = time.monotonic() - t
            if dt > 2:
                say("refresh took %.2f s (generation now %s)", dt, sender.generation)
            version += 1
            if mode == "direct":
                time.sleep(0.2)  # a training step
            sender.push(tensors(version), version)
        sender.close()
        return
    own = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    boxes = {n: (tuple(t.shape), full_box(t.shape)) for n, t in own.items()}
    receiver: ElasticReceiver

    def apply(receive) -> None:
        v = receive()
        g = receiver.generation.number
        say("received version %s in generation %d", v, g)
        if v is not None and g >= 2:
            state.redis.setnx(f"stress:{job}:done:{role}", json.dumps([time.time(), g, v]))

    receiver = ElasticReceiver(
        state,
        role,
        make_receiver=lambda group, n: ShardedReceiver(
            group, own, boxes, num_senders=n, zero_copy=True
        ),
        apply=apply,
        timeout=timeout,
    )
    while not stop():
        receiver.follow()
        time.sleep(receiver.poll_s)
    receiver._leave()


def trial(args, url: str, index: int, delay: float) -> dict:
    from nebula_rl.controller import JobState, connect

    job = f"s{args.seed}-t{index}"
    state = JobState(connect(url), job)
    r = state.redis
    roles = ["policy-0", "rollout-0", "rollout-1"]
    ids = {name: i + 1 for i, name in enumerate(roles)}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logfile = LOGS / f"{job}.log"
    logfile.unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                role,
                "--url",
                url,
                "--job",
                job,
                "--timeout",
                str(args.timeout),
                "--mode",
                args.mode,
                "--logfile",
                str(logfile),
            ],
            env=env,
        )
        for role in roles
    ]
    deadline = time.monotonic() + 60
    while not all(r.exists(f"stress:{job}:ready:{role}") for role in roles):
        if time.monotonic() > deadline:
            raise RuntimeError("children did not start")
        time.sleep(0.02)
    time.sleep(0.3)  # (their imports are done; let the sender reach its loop)
    g1 = state.publish_group("weights", roles[:2], ids=ids)["generation"]
    time.sleep(delay)
    t2 = time.time()
    g2 = state.publish_group("weights", roles, ids=ids)["generation"]
    regroups = 0
    dumped = False
    limit = time.monotonic() + args.trial_limit
    result = None
    while time.monotonic() < limit:
        done = [r.get(f"stress:{job}:done:{role}") for role in roles[1:]]
        if all(done):
            result = max(json.loads(d)[0] for d in done) - t2
            break
        current = state.group_record("weights")["generation"]
        if state.regroup_requested("weights") >= current:  # the controller's answer
            state.publish_group("weights", roles, ids=ids)
            regroups += 1
        if not dumped and time.time() - t2 > 4:
            for p in procs:
                p.send_signal(signal.SIGUSR1)
            dumped = True
        time.sleep(0.02)
    r.set(f"stress:{job}:stop", 1)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    final = state.group_record("weights")["generation"]
    return {
        "trial": index,
        "delay": round(delay, 3),
        "time_s": None if result is None else round(result, 2),
        "regroups": regroups,
        "generations": [g1, g2, final],
        "stalled": dumped,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--url")
    p.add_argument("--job")
    p.add_argument("--logfile")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--mode", default="tick", choices=["tick", "direct"], help="sender loop")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--max-delay", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trial-limit", type=float, default=75.0)
    args = p.parse_args()
    if args.child:
        child(args.child, args.url, args.job, args.timeout, args.mode, args.logfile)
        return
    from nebula_rl.controller import start_redis

    LOGS.mkdir(exist_ok=True)
    rng = random.Random(args.seed)
    results = []
    with start_redis(data_dir=LOGS / f"redis-{os.getpid()}") as server:
        for i in range(args.trials):
            res = trial(args, server.url, i, rng.uniform(0, args.max_delay))
            print(json.dumps(res), flush=True)
            results.append(res)
    stalled = [r for r in results if r["time_s"] is None or r["time_s"] > 5]
    times = sorted(r["time_s"] for r in results if r not in stalled)
    median = times[len(times) // 2] if times else float("nan")
    print(
        f"stalled {len(stalled)}/{len(results)} (times {[r['time_s'] for r in stalled]}); "
        f"the others: median {median} s, max {max(times, default=float('nan'))} s; "
        f"regroups {sum(r['regroups'] for r in results)} (logs in {LOGS})"
    )
    print(f"SUMMARY weight_group_join_stalls {len(stalled)}/{len(results)} goal 0")


if __name__ == "__main__":
    main()
