"""Data parallelism across policy replicas: two replica processes, each with half of the batch,
take the same steps as one process with the whole batch.

The replicas are spawned processes joined by a group whose TCPStore this test process serves
(`Rendezvous.hosted`, as the controller serves it in a job).
"""

import multiprocessing as mp
import os
import queue
import traceback

import pytest
import torch

from nebula_rl.config import config_from_dict
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.replicas import ReplicaGroup
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.weights import Rendezvous, build_group, free_port, serve_store

STEPS = 2
METRICS = ("loss", "pg_loss", "entropy", "reward_mean", "reward_std", "num_tokens", "grad_norm")


def _cfg():
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "train_policy": {"type": "grpo", "mini_batch": 3, "loss_type": "token-mean"},
            }
        }
    )


def _groups(step: int) -> list[RolloutGroup]:
    """Four groups whose answers differ in length, so a per-replica token mean would differ
    from the global one."""
    tok = build_char_tokenizer()
    groups = []
    for i in range(4):
        a, b = (3 * i + step) % 10, (7 * i + 2 * step) % 10
        answers = [str(a + b), str(a + b + 1) * (1 + i % 3), "x" * (i + 1), str(a)]
        rewards = [1.0, 0.0, 0.0, 1.0 if i % 2 else 0.0]
        comps = [
            Completion(tok.encode(s) + [tok.eos_token_id], [-1.5] * (len(s) + 1), s, "stop", [], r)
            for s, r in zip(answers, rewards, strict=True)
        ]
        prompt = Prompt(f"0:{i}", 0, i, f"{a}+{b}=", str(a + b))
        groups.append(RolloutGroup(prompt, tok.encode(prompt.prompt), comps))
    return groups


def _train(trainer: PolicyTrainer, *, rank: int, size: int) -> tuple[list[dict], list[float]]:
    history = []
    for step in range(STEPS):
        groups = _groups(step)
        share = len(groups) // size
        metrics = trainer.grpo_step(groups[rank * share : (rank + 1) * share])
        history.append({k: metrics[k] for k in METRICS})
    params = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    params += [float(p.detach().double().norm()) for p in trainer.model.parameters()]
    return history, params


def _replica(rank: int, port: int, out) -> None:
    try:
        torch.set_num_threads(1)
        group = build_group(Rendezvous("127.0.0.1", port, "dp", 2, hosted=True), rank=rank)
        model = load_model("tiny:qwen2", seed=1)
        trainer = PolicyTrainer(
            model, _cfg(), total_steps=STEPS, pad_id=0, replicas=ReplicaGroup(group)
        )
        out.put((rank, _train(trainer, rank=rank, size=2)))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()  # flush the report before leaving without interpreter teardown
        os._exit(0)


def test_two_replicas_step_like_one():
    port = free_port()
    store = serve_store("127.0.0.1", port)  # noqa: F841 (the rendezvous lives while it does)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    single = PolicyTrainer(load_model("tiny:qwen2", seed=1), _cfg(), total_steps=STEPS, pad_id=0)
    expected_history, expected_params = _train(single, rank=0, size=1)
    reports = {}
    try:
        while len(reports) < 2:
            rank, report = out.get(timeout=240)
            reports[rank] = report
    except queue.Empty:
        pytest.fail(f"replica(s) {sorted({0, 1} - set(reports))} did not report")
    for p in procs:
        p.join(timeout=30)
    for rank, report in reports.items():
        assert not isinstance(report, str), f"replica {rank} failed:\n{report}"
    # Both replicas applied the same updates: bit-identical parameters and metrics.
    assert reports[0] == reports[1]
    history, params = reports[0]
    for got, want in zip(history, expected_history, strict=True):
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert params == pytest.approx(expected_params, rel=1e-5, abs=1e-5)


def _joiner(rank: int, port: int, out) -> None:
    """Rank 0 trains two steps alone; rank 1 starts from other weights and no optimiser state.
    Then they form a group, agree on rank 0's state, and take one data-parallel step."""
    try:
        torch.set_num_threads(1)
        trainer = PolicyTrainer(
            load_model("tiny:qwen2", seed=1 if rank == 0 else 7), _cfg(), total_steps=4, pad_id=0
        )
        version = 0
        if rank == 0:
            for step in range(STEPS):
                trainer.grpo_step(_groups(step))
            version = STEPS
        group = build_group(Rendezvous("127.0.0.1", port, "join", 2, hosted=True), rank=rank)
        replicas = ReplicaGroup(group)
        agreed = replicas.sync_state(
            trainer.model, trainer.optimizer, trainer.scheduler, version=version, clean=True
        )
        trainer.replicas = replicas
        metrics = trainer.grpo_step(_groups(STEPS)[rank * 2 : (rank + 1) * 2])
        out.put((rank, (agreed, metrics["lr"], _fingerprint(trainer))))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def _fingerprint(trainer: PolicyTrainer) -> list[float]:
    """Sums of the parameters and of the optimiser's moments."""
    values = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    for state in trainer.optimizer.state.values():
        values += [float(state["exp_avg"].double().sum()), float(state["exp_avg_sq"].sum())]
    return values


def test_a_joining_replica_takes_the_state_of_a_live_one():
    """`ReplicaGroup.sync_state`: a replica that joins late receives the weights, optimiser
    moments and schedule of the one that trained, so their next data-parallel step equals the
    veteran's third step over the whole batch."""
    port = free_port()
    store = serve_store("127.0.0.1", port)  # noqa: F841 (the rendezvous lives while it does)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_joiner, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    single = PolicyTrainer(load_model("tiny:qwen2", seed=1), _cfg(), total_steps=4, pad_id=0)
    for step in range(STEPS + 1):
        metrics = single.grpo_step(_groups(step))
    reports = {}
    try:
        while len(reports) < 2:
            rank, report = out.get(timeout=240)
            reports[rank] = report
    except queue.Empty:
        pytest.fail(f"replica(s) {sorted({0, 1} - set(reports))} did not report")
    for p in procs:
        p.join(timeout=30)
    for rank, report in reports.items():
        assert not isinstance(report, str), f"replica {rank} failed:\n{report}"
    assert reports[0] == reports[1]  # identical after the joint step
    agreed, lr, fingerprint = reports[0]
    assert agreed == STEPS and lr == pytest.approx(metrics["lr"])
    assert fingerprint == pytest.approx(_fingerprint(single), rel=1e-5, abs=1e-5)
