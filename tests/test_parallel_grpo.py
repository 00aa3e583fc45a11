"""GRPO on a policy split over several processes takes the steps of one process.

Every rank of a 2- or 4-rank gloo world builds tiny:qwen2 alike, splits it with
`parallelize_policy` (and the reference with `parallelize_reference`), and calls
`PolicyTrainer.grpo_step` with the same scored groups, twice (AdamW). The metrics of both steps
and every parameter (gathered whole) must equal those of one process with the whole batch. The
config exercises what a step does besides the update: two slices (`batch_size_per_optimize`),
recomputed proximal log-probs, a KL penalty to the reference (its log-probs recomputed through
its own split model), an entropy bonus and gradient-norm clipping; the groups' completions differ
in length, so per-rank token means would differ from the global one.

Tolerances: the layouts sum the same numbers in another order (sharded matmuls, reduce-scatter,
micro-batches), so float32 round-off differs. Measured: metrics within 2e-7 relative, parameters
within 2e-6 absolute (see `test_parallel_grpo_steps_like_one_process`); `TOL` = 1e-5 (5x). One
step moves a parameter by about the learning rate (1e-3, 100x `TOL`), so one wrong update shows,
and so does a wrong data-parallel share (checked by hand: taking every row on every rank fails).
`epsilon` = 1e-6 as in test_parallelize.py: Adam would turn round-off gradients (a key bias's)
into steps of size lr.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from member_pool import MemberPool
from nebula_rl.config import config_from_dict
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.setup import parallelize_policy, parallelize_reference
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.weights import free_port

STEPS = 2
TOL = 1e-5
SEED = 4


def _cfg(parallelism: dict, **policy) -> object:
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "optm_grad_norm_clip": 0.5,
                "epsilon": 1e-6,
                "train_policy": {
                    "type": "grpo",
                    "mini_batch": 2,
                    "batch_size_per_optimize": 6,
                    "loss_type": "token-mean",
                    "use_rollout_logprobs_for_loss": False,
                    "kl_beta": 0.05,
                    "entropy_coeff": 0.01,
                    **policy,
                },
            },
            "policy": {"parallelism": parallelism},
        }
    )


def _groups(step: int) -> list[RolloutGroup]:
    """Three groups of three completions of different lengths (9 sequences: two slices of 6
    and 3, shared unevenly by two data-parallel ranks)."""
    tok = build_char_tokenizer()
    groups = []
    for i in range(3):
        a, b = (3 * i + step) % 10, (7 * i + 2 * step) % 10
        answers = [str(a + b), "x" * (2 + 3 * i), str(a) * (1 + i)]
        rewards = [1.0, 0.0, float(i % 2)]
        comps = [
            Completion(tok.encode(s) + [tok.eos_token_id], [-1.5] * (len(s) + 1), s, "stop", [], r)
            for s, r in zip(answers, rewards, strict=True)
        ]
        prompt = Prompt(f"0:{i}", 0, i, f"{a}+{b}=", str(a + b))
        groups.append(RolloutGroup(prompt, tok.encode(prompt.prompt), comps))
    return groups


def _train(trainer: PolicyTrainer) -> list[dict]:
    return [trainer.grpo_step(_groups(step)) for step in range(STEPS)]


def _one_process(policy: dict) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = _cfg({}, **policy)
    model = load_model("tiny:qwen2", seed=SEED)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=0, ref_model=ref)
    history = _train(trainer)
    # (a tied embedding under both names: PP ranks report both copies)
    return history, {
        n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
    }


def _member(rank: int, world_size: int, port: int, parallelism: dict, policy: dict):
    """One rank of the split policy: its metrics of every step and the whole model."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        cfg = _cfg(parallelism, **policy)
        model = load_model("tiny:qwen2", seed=SEED)
        ref = copy.deepcopy(model)
        split = parallelize_policy(model, cfg)
        trainer = PolicyTrainer(
            split.model,
            cfg,
            total_steps=10,
            pad_id=0,
            ref_model=parallelize_reference(ref, split, cfg),
            data_parallel=split.data_parallel,
        )
        history = _train(trainer)
        params = {
            name: tensor.cpu().numpy().copy()  # numpy: plain pickling, no shared memory
            for name, tensor in split.model.full_named_parameters()
        }
        return history, params, (split.dp_rank, split.dp_size)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def members():
    pool = MemberPool(4)
    yield pool
    pool.close()


PP = {"pp_size": 2, "dp_shard_size": 1}
INTERLEAVED = {"pp_schedule": "Interleaved1F1B", "pp_layers_per_stage": 1}  # 2 stages per rank
CASES = {  # case: (world size, [policy.parallelism], [train.train_policy], data-parallel size)
    # mini_batch 1: one rank runs more forward passes than the other in the 3-row slice (the
    # other then runs a dummy one, for FSDP's collectives to pair up)
    "fsdp": (2, {"dp_shard_size": 2}, {"mini_batch": 1}, 2),
    "tp": (2, {"tp_size": 2}, {}, 1),
    "pp_1f1b": (2, {**PP, "pp_schedule": "1F1B"}, {}, 1),
    "pp_gpipe": (2, {**PP, "pp_schedule": "GPipe"}, {}, 1),
    "pp_interleaved": (2, {**PP, **INTERLEAVED}, {}, 1),
    # the data-parallel ranks of a stage pad their passes to one shape
    "pp_x_fsdp": (4, {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "1F1B"}, {}, 2),
    # each sequence's tokens split over 2 ranks (keys and values all-gathered on CPU)
    "cp": (2, {"cp_size": 2, "dp_shard_size": 1}, {}, 1),
    "fsdp_x_cp": (4, {"cp_size": 2, "dp_shard_size": 2}, {"mini_batch": 1}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_grpo_steps_like_one_process(members, case):
    world_size, parallelism, policy, num_dp = CASES[case]
    want_history, want_params = _one_process(policy)
    port = free_port()
    reports = members.run_on(
        range(world_size), _member, world_size, port, parallelism, policy, timeout_s=240
    )
    unique = {n for n, _ in load_model("tiny:qwen2", seed=SEED).named_parameters()}
    for rank, (history, params, (_, dp_size)) in sorted(reports.items()):
        assert dp_size == num_dp
        for step, (got, want) in enumerate(zip(history, want_history, strict=True)):
            assert got.keys() == want.keys(), (rank, step)
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), (rank, step, key)
        assert unique <= params.keys() <= want_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(
                torch.from_numpy(value), want_params[name], rtol=0, atol=TOL,
                msg=lambda m, name=name, rank=rank: f"rank {rank}, {name}: {m}",
            )  # fmt: skip
    # The steps moved the parameters well beyond the tolerance, so a wrong update would show.
    start = load_model("tiny:qwen2", seed=SEED)
    moved = max(
        float((want_params[n] - p.detach()).abs().max()) for n, p in start.named_parameters()
    )
    assert moved > 50 * TOL
