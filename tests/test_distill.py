"""On-policy distillation: the advantage shaping against direct computations, the config rules,
the teacher's scores, and the policy step that trains on them."""

import dataclasses
import json
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from nebula_rl import local
from nebula_rl.algorithms import (
    discounted_future_sum,
    distillation_advantages,
    sampled_token_divergence,
    top_k_divergence,
)
from nebula_rl.config import ConfigError, config_from_dict, load_config, refusals
from nebula_rl.controller import JobState, connect
from nebula_rl.models import load_model, load_tokenizer
from nebula_rl.policy.teacher import Teacher, check_same_tokenizer
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, GroupHeader, Prompt, RolloutGroup, from_json

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "cosmos-rl"


def _cfg(distillation=None, parallelism=None, **policy):
    return config_from_dict(
        {
            "train": {
                "output_dir": "unused",
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "train_batch_per_replica": 4,
                "train_policy": {
                    "type": "grpo",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "reward_function": "arithmetic",
                    "mini_batch": 4,
                    "dataset": {"name": "builtin:arithmetic"},
                    **policy,
                },
            },
            "policy": {"model_name_or_path": "tiny:qwen2", "parallelism": parallelism or {}},
            "rollout": {"backend": "torch", "n_generation": 2, "max_response_length": 4},
            "distillation": {
                "enable": True,
                "model_name_or_path": "tiny:qwen2",
                "compile": False,
                "param_dtype": "float32",
                **(distillation or {}),
            },
        }
    )


# -- shaping -------------------------------------------------------------------------------------


def test_sampled_token_penalty_without_discount_is_minus_coef_times_log_ratio():
    student = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, -0.1, 0.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-1.0, -0.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    d = sampled_token_divergence(student, teacher)
    shaped = distillation_advantages(d, mask, kl_penalty_coef=0.5, kl_discount_factor=0.0)
    expected = torch.tensor([[-0.25, 0.5, 0.0, 0.0], [0.0, -0.05, 0.0, 0.0]])
    torch.testing.assert_close(shaped, expected)


def test_discounted_penalty_is_the_future_sum_over_the_sequence_tokens():
    d = torch.tensor([[0.0, 1.0, 2.0, -1.0, 5.0], [3.0, 0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    gamma, coef = 0.9, 2.0
    shaped = distillation_advantages(d, mask, kl_penalty_coef=coef, kl_discount_factor=gamma)
    expected = torch.zeros_like(d)
    for b in range(d.shape[0]):
        positions = [t for t in range(d.shape[1]) if mask[b, t] > 0]
        for i, t in enumerate(positions):
            expected[b, t] = sum(
                gamma**j * -coef * float(d[b, u]) for j, u in enumerate(positions[i:])
            )
    torch.testing.assert_close(shaped, expected)
    # gamma 0 is each token's own penalty
    torch.testing.assert_close(discounted_future_sum(d * mask, mask, 0.0), d * mask)


def _direct_jsd(s: list[float], t: list[float], beta: float) -> float:
    """sum_k of the generalised JSD terms, written out with probabilities."""
    total = 0.0
    for ls, lt in zip(s, t, strict=True):
        ps, pt = math.exp(ls), math.exp(lt)
        if beta == 0.0:
            total += pt * math.log(pt / ps)
        elif beta == 1.0:
            total += ps * math.log(ps / pt)
        else:
            m = beta * pt + (1 - beta) * ps
            total += beta * pt * math.log(pt / m) + (1 - beta) * ps * math.log(ps / m)
    return total


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.2])
def test_top_k_jsd_matches_a_direct_computation(beta):
    g = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.randn(2, 3, 8, generator=g), -1)[..., :4]
    teacher = torch.log_softmax(torch.randn(2, 3, 8, generator=g), -1)[..., :4]
    got = top_k_divergence(student, teacher, beta=beta)
    assert got.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            want = _direct_jsd(student[b, t].tolist(), teacher[b, t].tolist(), beta)
            assert got[b, t].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    same = top_k_divergence(teacher, teacher, beta=beta)
    torch.testing.assert_close(same, torch.zeros_like(same))


def test_divergence_carries_no_gradient_into_the_student():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    d = sampled_token_divergence(student, torch.tensor([[-1.5, -1.0]]))
    assert not d.requires_grad
    k = top_k_divergence(student[..., None], torch.tensor([[[-1.5], [-1.0]]]), beta=0.5)
    assert not k.requires_grad


# -- config --------------------------------------------------------------------------------------


def test_enable_forces_bypass_reward_and_top_k_zero_takes_no_teacher_ids():
    cfg = _cfg({"top_k": 0, "trainer_token_ids_from_teacher": True}, bypass_reward=False)
    assert cfg.grpo.bypass_reward is True
    assert cfg.distillation.trainer_token_ids_from_teacher is False
    off = config_from_dict({"distillation": {"enable": False, "top_k": 5}})
    assert off.distillation.top_k == 0
    assert refusals(cfg, {}) == []


def test_unbuilt_distillation_settings_are_refused_by_name():
    for key in ("include_prompt", "rollout_top_k_recompute", "sequence_packing", "fsdp_offload"):
        with pytest.raises(ConfigError, match=f"distillation.{key} = true: "):
            _cfg({key: True})
    with pytest.raises(ConfigError, match=r"distillation\.kl_discount_factor = 0\.9: "):
        _cfg({"kl_discount_factor": 0.9}, parallelism={"cp_size": 2})
    with pytest.raises(ConfigError, match="trainer_token_ids_from_teacher = false: "):
        _cfg({"top_k": 4, "trainer_token_ids_from_teacher": False})
    with pytest.raises(ConfigError, match=r'needs train\.train_policy\.type = "grpo"'):
        config_from_dict(
            {"train": {"train_policy": {"type": "sft"}}, "distillation": {"enable": True}}
        )
    with pytest.raises(ConfigError, match=r"distillation\.jsd_beta"):
        _cfg({"jsd_beta": 1.5})


def test_teacher_with_another_tokenizer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"distillation\.model_name_or_path .* another tokenizer"):
        check_same_tokenizer(_cfg({"model_name_or_path": "tiny:qwen2_gsm8k"}))


def test_split_teacher_is_refused_in_the_single_process_run():
    with pytest.raises(ValueError, match=r"distillation\.parallelism"):
        Teacher(_cfg({"parallelism": {"dp_shard_size": 2}}), device="cpu")


# -- teacher and trainer -------------------------------------------------------------------------


def _groups(tokenizer) -> list[RolloutGroup]:
    prompt = tokenizer("3+4=")["input_ids"]
    completions = [
        Completion(tokenizer("7")["input_ids"], [-1.0], "7", "stop", [(0, 0)]),
        Completion(tokenizer("12")["input_ids"][:2], [-2.0, -3.0][:2], "12", "stop", [(0, 0)]),
    ]
    completions = [dataclasses.replace(c, logprobs=[-1.0] * len(c.token_ids)) for c in completions]
    return [RolloutGroup(Prompt("0:0", 0, 0, "3+4=", "7"), prompt, completions)]


@pytest.mark.parametrize("top_k", [0, 3])
def test_teacher_scores_are_its_log_softmax_at_the_completion_tokens(top_k):
    cfg = _cfg({"top_k": top_k, "mini_batch": 1})
    teacher = Teacher(cfg, device="cpu")
    groups = _groups(load_tokenizer("tiny:qwen2"))
    scored = teacher.score(groups)
    for g in scored:
        for c in g.completions:
            ids = torch.tensor([g.prompt_token_ids + c.token_ids])
            logits = teacher.model(input_ids=ids).logits[0]
            lp = torch.log_softmax(logits.float(), -1)
            p = len(g.prompt_token_ids)
            want = [lp[p - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
            assert c.teacher_logprobs == pytest.approx(want, abs=1e-4)
            if top_k:
                top = lp[p - 1 : p - 1 + len(c.token_ids)].topk(top_k, -1)
                assert c.teacher_top_k_ids == top.indices.tolist()
                flat = [x for row in c.teacher_top_k_logprobs for x in row]
                assert flat == pytest.approx(top.values.flatten().tolist(), abs=1e-4)


@pytest.mark.parametrize("top_k", [0, 3])
def test_policy_step_trains_on_the_teacher_divergence(top_k):
    """A student that is its own teacher has divergence 0 and so no gradient (no task reward);
    with another teacher, the step's `distill_kl` is the mean divergence computed directly,
    and with top_k 0 the updates lower it.

    (The teacher's forward passes batch the rows otherwise than the policy's, so on some CPUs
    its log-probs differ from the student's in the last bits; AdamW turns a gradient of that
    noise into steps of the learning rate's size. So the self-teacher's gradient is compared
    with another teacher's, not the weights before and after.)"""
    cfg = _cfg({"top_k": top_k}, use_rollout_logprobs_for_loss=False)
    tokenizer = load_tokenizer("tiny:qwen2")
    student = load_model("tiny:qwen2", seed=5)
    groups = _groups(tokenizer)

    same = Teacher(cfg, device="cpu")
    same.model.load_state_dict(student.state_dict())
    trainer = PolicyTrainer(student, cfg, total_steps=4, pad_id=tokenizer.pad_token_id)
    metrics = trainer.grpo_step(same.score(groups))
    assert metrics["distill_kl"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(0.0, abs=1e-5)

    other = Teacher(cfg, device="cpu")  # seed 0: another random model
    scored = other.score(groups)
    d = []
    with torch.no_grad():
        for g in scored:
            for c in g.completions:
                ids = torch.tensor([g.prompt_token_ids + c.token_ids])
                p = len(g.prompt_token_ids)
                lp = torch.log_softmax(student(input_ids=ids).logits[0].float(), -1)
                for i, tok in enumerate(c.token_ids):
                    if top_k == 0:  # log pi_student - log pi_teacher of the sampled token
                        d.append(lp[p - 1 + i, tok].item() - c.teacher_logprobs[i])
                    else:  # the JSD over the teacher's top 3
                        on_ids = lp[p - 1 + i, c.teacher_top_k_ids[i]].tolist()
                        d.append(_direct_jsd(on_ids, c.teacher_top_k_logprobs[i], 0.5))
    first = trainer.grpo_step(scored)
    assert first["distill_kl"] == pytest.approx(sum(d) / len(d), rel=1e-3, abs=1e-6)
    assert abs(first["distill_kl"]) > 1e-4
    # the self-teacher's gradient is float noise beside a real divergence's
    assert metrics["grad_norm"] < 1e-4 * first["grad_norm"], (metrics, first)
    if top_k == 0:
        # At ratio 1 the loss is the mean log-ratio itself: the update lowers it on these tokens
        # (the top-k JSD is a reward for the sampled token, not a loss the step descends).
        for _ in range(3):
            last = trainer.grpo_step(scored)
        assert last["distill_kl"] < first["distill_kl"] - 0.1


# -- the demo ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_distills_the_warm_start_into_a_fresh_student(tmp_path):
    """configs/demo_distill.toml, shortened: the teacher is a 30-step SFT warm start of
    demo_sft.toml (the answer format and some addition), the student a freshly initialised tiny
    Qwen2 of the same tokenizer, trained on the teacher's per-token log-ratio alone (reward 0).
    Measured: the mean per-token reverse KL falls from ~4.5 to ~2.5 in 12 steps (4.5 -> 1.2 in
    20); the test asks the mean of steps 10-12 to be at least 1.0 below that of steps 1-3."""
    sft = load_config(ROOT / "configs" / "demo_sft.toml")
    sft.train.output_dir = str(tmp_path)
    sft.train.max_num_steps = 30
    local.run(sft)
    cfg = load_config(ROOT / "configs" / "demo_distill.toml")
    assert cfg.distillation.enable and cfg.grpo.bypass_reward
    assert cfg.policy.model_name_or_path == "tiny:qwen2"  # a fresh student
    cfg.train.output_dir = str(tmp_path)
    cfg.train.timestamp = "distill"
    cfg.train.max_num_steps = 12
    cfg.distillation.model_name_or_path = str(tmp_path / "warmstart" / "safetensors" / "final")
    run = local.run(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["distill_kl"] for r in records]
    assert len(kl) == 12 and all(r["reward_mean"] == 0.0 for r in records)
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 2.0, kl  # a fresh student is far from the teacher
    assert last <= first - 1.0, kl


# -- teacher replicas ----------------------------------------------------------------------------


def test_groups_wait_for_a_teacher_and_a_dead_teachers_groups_go_to_another(redis_server):
    """A training group enters the controller's `groups` stream only once scored; the groups a
    teacher held when it died are scored by another, none lost."""
    state = JobState(connect(redis_server.url), "job")
    group = _groups(load_tokenizer("tiny:qwen2"))[0]
    state.push_for_teacher(group)
    assert state.read_groups(10) == [] and state.teacher_backlog() == 1
    [(held, _)] = state.claim_for_teacher("teacher-0", 4)
    assert state.claim_for_teacher("teacher-1", 4) == []  # held by teacher-0
    state.register_replica("teacher-0", role="teacher", host="h", world_size=1)
    assert state.requeue_pending("teacher-0") == 1  # it died: its groups go back
    [(msg_id, again)] = state.claim_for_teacher("teacher-1", 4)
    assert msg_id != held and again == group
    scored = Teacher(_cfg(), device="cpu").score([again])[0]
    state.push_scored(msg_id, scored)
    assert state.teacher_backlog() == 0
    [pushed] = state.read_groups(10)
    assert from_json(RolloutGroup, pushed.body) == scored
    assert pushed.header == GroupHeader.of(group)  # scoring changes no judged field


@pytest.mark.slow
def test_job_with_two_teacher_replicas_trains_every_prompt_once_on_scored_groups(
    tmp_path, grpo_job_config
):
    """`nebula-rl train --teacher 2`: Redis, the controller, a policy, a rollout and two teacher
    replicas as processes; every step trains on teacher-scored groups (the policy refuses an
    unscored one), and every prompt is trained exactly once."""
    cfg = grpo_job_config(
        {
            "distillation": {
                "enable": True,
                "model_name_or_path": "tiny:qwen2",
                "seed": 11,  # another random model than the student
                "compile": False,
                "param_dtype": "float32",
                "batch_size_per_replica": 4,
            }
        },
        timestamp="distill",
        num_rows=16,
        allowed=1,
    )
    config = tmp_path / "job.json"
    config.write_text(cfg.model_dump_json())
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config), "--teacher", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    run_dir = Path(cfg.train.output_dir) / "distill"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in run_dir.glob("logs/*.log"))
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{logs}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "policy_version" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["distill_kl"] != 0.0 and r["reward_mean"] == 0.0 for r in steps)
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["0"]["trained"] == {str(i): 1 for i in range(16)}
    scored = [
        int(m.group(1))
        for name in ("teacher-0", "teacher-1")
        for m in re.finditer(r"scored (\d+) groups", (run_dir / "logs" / f"{name}.log").read_text())
    ]
    assert sum(scored) >= 16 and len(scored) == 2


def test_cosmos_distill_countdown_config_runs_shrunk_to_cpu(tmp_path):
    """cosmos-rl's qwen2-5-1.5b-distill-countdown.toml as shipped but for what this machine
    cannot hold: tiny models for the 1.5B student and 7B teacher (one tokenizer), the built-in
    task for the Hub dataset, single-process sizes, the torch engine, no validation, 2 steps.
    Its own settings stay: token-sum loss without clipping, Adam, bf16 compute, top_k 0."""
    path = DATA / "configs" / "qwen2-5" / "qwen2-5-1.5b-distill-countdown.toml"
    data = tomllib.loads(path.read_text())
    data.pop("redis")
    data["train"] |= {"output_dir": str(tmp_path), "timestamp": "run", "max_num_steps": 2}
    data["train"] |= {"train_batch_per_replica": 8, "optm_name": "Adam"}
    data["train"]["ckpt"]["enable_checkpoint"] = False
    policy = data["train"]["train_policy"]
    policy |= {"prompt_column_name": "prompt", "mini_batch": 4}
    policy["dataset"] = {"name": "builtin:arithmetic", "kwargs": {"num_samples": 16}}
    data["validation"]["enable"] = False
    data["logging"]["logger"] = ["console"]
    data["policy"] |= {"model_name_or_path": "tiny:qwen2", "model_max_length": 64}
    data["policy"]["parallelism"] = {"dp_shard_size": 1}
    del data["rollout"]["gpu_memory_utilization"]
    data["rollout"] |= {"backend": "torch", "max_response_length": 4, "batch_size": 2}
    data["rollout"]["parallelism"] = {"tp_size": 1}
    data["distillation"] |= {"model_name_or_path": "tiny:qwen2", "seed": 9, "compile": False}
    data["distillation"]["parallelism"] = {"dp_shard_size": 1}
    cfg = config_from_dict(data, source=str(path))
    assert cfg.grpo.bypass_reward and cfg.grpo.loss_type == "token-sum"
    assert cfg.distillation.param_dtype == "bfloat16" and cfg.grpo.epsilon_low == -1.0
    run = local.run(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["distill_kl"] != 0.0 and r["reward_mean"] == 0.0 for r in records)
