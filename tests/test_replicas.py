"""Data parallelism across policy replicas: two replica processes, each with half of the batch,
take the same steps as one process with the whole batch.

The replicas are spawned processes joined by a group whose TCPStore this test process serves
(`Rendezvous.hosted`, as the controller serves it in a job).
"""

import os
import queue
import traceback

import pytest
import torch

from conftest import rank_context
from nebula_rl.config import config_from_dict
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.replicas import ReplicaGroup
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.weights import Rendezvous, build_group, free_port, serve_store

STEPS = 2
METRICS = ("loss", "pg_loss", "entropy", "reward_mean", "reward_std", "num_tokens", "grad_norm")


def _cfg(**train):
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                **train,
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
    ctx = rank_context()
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
            load_model("tiny:qwen2", seed=1 if rank == 0 else 7),
            _cfg(**EMA),
            total_steps=4,
            pad_id=0,
        )
        version = 0
        if rank == 0:
            for step in range(STEPS):
                trainer.grpo_step(_groups(step))
            version = STEPS
        group = build_group(Rendezvous("127.0.0.1", port, "join", 2, hosted=True), rank=rank)
        replicas = ReplicaGroup(group)
        agreed = replicas.sync_state(
            trainer.model,
            trainer.optimizer,
            trainer.scheduler,
            version=version,
            clean=True,
            ema=trainer.ema,
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


EMA = {"ema_enable": True, "ema_decay": 0.5}
"""Weight averages, which a joining replica takes too."""


def _fingerprint(trainer: PolicyTrainer) -> list[float]:
    """Sums of the parameters, of the optimiser's moments and of the weight averages, and the
    optimiser steps the averages have seen."""
    values = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
    for state in trainer.optimizer.state.values():
        values += [float(state["exp_avg"].double().sum()), float(state["exp_avg_sq"].sum())]
    if trainer.ema is not None:
        values += [float(a.double().sum()) for a in trainer.ema.averages]
        values.append(float(trainer.ema.steps))
    return values


def test_a_joining_replica_takes_the_state_of_a_live_one():
    """`ReplicaGroup.sync_state`: a replica that joins late receives the weights, optimiser
    moments, schedule and weight averages of the one that trained, so their next data-parallel
    step equals the veteran's third step over the whole batch."""
    port = free_port()
    store = serve_store("127.0.0.1", port)  # noqa: F841 (the rendezvous lives while it does)
    ctx = rank_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_joiner, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    single = PolicyTrainer(load_model("tiny:qwen2", seed=1), _cfg(**EMA), total_steps=4, pad_id=0)
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


def _sgd(trainer: PolicyTrainer) -> PolicyTrainer:
    """SGD at lr 1 and a constant schedule: updates add up exactly, so they can be compared."""
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    return trainer


def _fingerprint_params(model: torch.nn.Module) -> list[float]:
    values = [float(p.detach().double().sum()) for p in model.parameters()]
    return values + [float(p.detach().double().norm()) for p in model.parameters()]


def _sft_examples(rank: int) -> list[tuple[list[int], list[int]]]:
    """Short answers on rank 0, long ones on rank 1: their token means weigh differently."""
    from nebula_rl.data import sft_example

    tok = build_char_tokenizer()
    answers = ["7", "12"] if rank == 0 else ["the answer is 1234", "it is 99, as 9 * 11 = 99"]
    return [
        sft_example(
            tok, [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": a}]
        )
        for i, a in enumerate(answers)
    ]


def _case_cfg(case: str):
    train = {"optm_lr": 1e-3, "optm_warmup_steps": 0, "optm_grad_norm_clip": 0.0}
    if case == "sft_unbalanced":
        policy = {"type": "sft", "mini_batch": 1, "balance_dp_token": False}
    else:
        policy = {"type": "grpo", "mini_batch": 3, "loss_type": "token-mean"}
        policy |= (
            {"batch_size_per_optimize": 4} if case == "slices" else {"balance_dp_token": False}
        )
    return config_from_dict({"train": {**train, "train_policy": policy}})


def _case_step(trainer: PolicyTrainer, case: str, rank: int) -> dict:
    """Rank `rank`'s share of the case's step (rank 0 of 2 holds two groups, rank 1 one group,
    for "slices")."""
    if case == "sft_unbalanced":
        return trainer.sft_step(_sft_examples(rank))
    groups = _groups(0)
    share = {"slices": [[0, 2], [1]], "grpo_unbalanced": [[0, 1], [2, 3]]}[case][rank]
    return trainer.grpo_step([groups[i] for i in share])


def _case_replica(rank: int, port: int, case: str, out) -> None:
    try:
        torch.set_num_threads(1)
        group = build_group(Rendezvous("127.0.0.1", port, case, 2, hosted=True), rank=rank)
        trainer = _sgd(
            PolicyTrainer(
                load_model("tiny:qwen2", seed=1),
                _case_cfg(case),
                total_steps=2,
                pad_id=0,
                replicas=ReplicaGroup(group),
            )
        )
        metrics = _case_step(trainer, case, rank)
        out.put(
            (rank, (metrics["loss"], trainer.planned_updates, _fingerprint_params(trainer.model)))
        )
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def _run_pair(case: str) -> tuple:
    port = free_port()
    store = serve_store("127.0.0.1", port)  # noqa: F841 (the rendezvous lives while it does)
    ctx = rank_context()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_case_replica, args=(r, port, case, out), daemon=True) for r in range(2)
    ]
    for p in procs:
        p.start()
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
    assert reports[0] == reports[1]  # the same updates on both
    return reports[0]


def test_replicas_agree_on_the_number_of_slice_updates():
    """`batch_size_per_optimize = 4`: rank 0 has two groups (two slices), rank 1 one; both take
    two updates, the second one with rank 1 contributing nothing. That is one step over the two
    first groups, then one over the third."""
    _, planned, params = _run_pair("slices")
    assert planned == 2
    groups = _groups(0)
    single = _sgd(PolicyTrainer(load_model("tiny:qwen2", seed=1), _cfg(), total_steps=2, pad_id=0))
    single.grpo_step([groups[0], groups[1]])
    single.grpo_step([groups[2]])
    assert params == pytest.approx(_fingerprint_params(single.model), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("case", ["grpo_unbalanced", "sft_unbalanced"])
def test_unbalanced_token_mean_averages_each_replicas_own_mean(case):
    """`balance_dp_token = false`: each replica normalises by its own token count, so the step is
    the mean of the replicas' separate steps (their shares hold different numbers of tokens,
    so the global token mean would differ)."""
    loss, _, params = _run_pair(case)
    alone = []
    for rank in (0, 1):
        trainer = _sgd(
            PolicyTrainer(
                load_model("tiny:qwen2", seed=1), _case_cfg(case), total_steps=2, pad_id=0
            )
        )
        alone.append((_case_step(trainer, case, rank)["loss"], _fingerprint_params(trainer.model)))
    assert loss == pytest.approx((alone[0][0] + alone[1][0]) / 2, rel=1e-5)
    # With SGD each parameter moves by the mean of the two separate moves; its sum too.
    start = _fingerprint_params(load_model("tiny:qwen2", seed=1))
    n = len(start) // 2
    expected = [
        s + ((a - s) + (b - s)) / 2 for s, a, b in zip(start, alone[0][1], alone[1][1], strict=True)
    ][:n]
    assert params[:n] == pytest.approx(expected, rel=1e-5, abs=1e-5)
