import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from nebula_rl.config import config_from_dict
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.trainer import PolicyTrainer, collate_groups, lr_lambda, token_logprobs
from nebula_rl.protocol import Completion, Prompt, RolloutGroup


def _cfg(**policy):
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "optm_grad_norm_clip": 0.0,
                "train_policy": {
                    "type": "grpo",
                    "mini_batch": 8,
                    "loss_type": "token-mean",
                    **policy,
                },
            }
        }
    )


def _group(tok, prompt, answers, rewards, version=0):
    ids = tok.encode(prompt)
    comps = [
        Completion(
            tok.encode(a) + [tok.eos_token_id], [-1.0] * (len(a) + 1), a, "stop", [(0, version)], r
        )
        for a, r in zip(answers, rewards, strict=True)
    ]
    return RolloutGroup(Prompt("0:0", 0, 0, prompt, ""), ids, comps)


def test_token_logprobs_match_manual_gather():
    model = load_model("tiny:qwen2", seed=1)
    x = torch.randint(4, 100, (3, 9))
    lp, ent = token_logprobs(model, x, torch.ones_like(x), temperature=0.5, with_entropy=True)
    logits = model(x).logits[:, :-1] / 0.5
    expected = F.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expected)
    probs = F.softmax(logits, -1)
    torch.testing.assert_close(ent, -(probs * probs.log()).sum(-1))


def test_collate_marks_response_targets_only():
    tok = build_char_tokenizer()
    g = _group(tok, "12+3=", ["15", "9"], [1.0, 0.0])
    batch = collate_groups([g], torch.tensor([[0.5, -0.5]]), pad_id=tok.pad_token_id)
    assert batch.input_ids.shape == (2, 5 + 3)
    # Row 1 ("9"+eos) is shorter and right-padded.
    assert batch.attention_mask[1].tolist() == [1] * 7 + [0]
    # Target position t predicts token t+1: the response starts at token 5, so target 4.
    assert batch.target_mask[0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert batch.target_mask[1].tolist() == [0, 0, 0, 0, 1, 1, 0]
    assert batch.behaviour_logprobs[0, 4:].tolist() == [-1.0, -1.0, -1.0]
    assert batch.advantages.tolist() == [0.5, -0.5]


@torch.no_grad()
def _logp_of(model, tok, prompt, answer):
    ids = tok.encode(prompt) + tok.encode(answer) + [tok.eos_token_id]
    x = torch.tensor([ids])
    lp, _ = token_logprobs(model, x, torch.ones_like(x))
    return float(lp[0, len(tok.encode(prompt)) - 1 :].sum())


@torch.no_grad()
def _sampled_by(model, group, *, shift=0.0):
    """`group` with each completion's log-probs as `model` gives them (minus `shift`): what a
    rollout holding these weights would have recorded."""
    comps = []
    for c in group.completions:
        x = torch.tensor([group.prompt_token_ids + c.token_ids])
        lp, _ = token_logprobs(model, x, torch.ones_like(x))
        own = lp[0, len(group.prompt_token_ids) - 1 :].tolist()
        comps.append(dataclasses.replace(c, logprobs=[v - shift for v in own]))
    return dataclasses.replace(group, completions=comps)


def test_grpo_step_moves_probability_towards_rewarded_answers():
    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=2)
    trainer = PolicyTrainer(model, _cfg(), total_steps=10, pad_id=tok.pad_token_id)
    group = _group(tok, "7+1=", ["8", "3", "5", "1"], [1.0, 0.0, 0.0, 0.0])
    good0, bad0 = _logp_of(model, tok, "7+1=", "8"), _logp_of(model, tok, "7+1=", "3")
    for _ in range(3):
        metrics = trainer.grpo_step([_sampled_by(model, group)])
        assert metrics["clip_frac"] == 0.0  # on-policy: the ratio starts at 1
    assert _logp_of(model, tok, "7+1=", "8") > good0 + 0.5
    assert _logp_of(model, tok, "7+1=", "3") < bad0
    assert metrics["reward_mean"] == 0.25
    assert metrics["num_sequences"] == 4


def test_all_equal_rewards_leave_the_model_unchanged():
    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=2)
    before = copy.deepcopy(model.state_dict())
    trainer = PolicyTrainer(model, _cfg(), total_steps=10, pad_id=tok.pad_token_id)
    trainer.grpo_step([_group(tok, "1+1=", ["2", "3"], [1.0, 1.0])])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)


@pytest.mark.parametrize("variant", ["grpo", "dapo", "gspo"])
def test_update_does_not_depend_on_micro_batch_split(variant):
    tok = build_char_tokenizer()
    groups = [
        _group(tok, "2+2=", ["4", "22", "5", "0"], [1.0, 0.0, 0.0, 1.0]),
        _group(tok, "3+4=", ["7", "1", "34", "77"], [1.0, 0.0, 0.0, 0.0]),
    ]
    results = []
    for mini_batch in (1, 3, 8):
        model = load_model("tiny:qwen2", seed=5)
        cfg = _cfg(mini_batch=mini_batch, variant=variant, loss_type="seq-mean-token-mean")
        trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=tok.pad_token_id)
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
        trainer.grpo_step(groups)
        results.append(model.model.layers[0].self_attn.q_proj.weight.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(results[0], results[2], rtol=0, atol=1e-5)


def test_mu_iterations_and_kl_run_and_report():
    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=2)
    ref = copy.deepcopy(model).requires_grad_(False)
    cfg = _cfg(mu_iterations=3, kl_beta=0.1, entropy_coeff=0.01)
    trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=tok.pad_token_id, ref_model=ref)
    m = trainer.grpo_step([_group(tok, "5+5=", ["10", "11"], [1.0, 0.0])])
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # first pass: policy == reference
    assert m["entropy"] > 0
    m2 = trainer.grpo_step([_group(tok, "5+5=", ["10", "11"], [1.0, 0.0])])
    assert m2["kl"] > 0  # three optimiser steps later the policy has moved


def test_sft_step_fits_a_repeated_batch():
    from nebula_rl.data import sft_example

    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=0)
    cfg = config_from_dict(
        {
            "train": {
                "optm_lr": 3e-3,
                "optm_warmup_steps": 0,
                "train_policy": {"type": "sft", "mini_batch": 2},
            }
        }
    )
    trainer = PolicyTrainer(model, cfg, total_steps=30, pad_id=tok.pad_token_id)
    examples = [
        sft_example(
            tok,
            [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}],
        )
        for i in range(4)
    ]
    first = trainer.sft_step(examples)["loss"]
    for _ in range(25):
        last = trainer.sft_step(examples)["loss"]
    assert last < first / 4


def test_lr_schedule_warmup_and_cosine_floor():
    cfg = config_from_dict(
        {"train": {"optm_warmup_steps": 4, "optm_decay_type": "cosine", "optm_min_lr_factor": 0.1}}
    )
    f = lr_lambda(cfg.train, total_steps=14)
    assert [round(f(s), 3) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(14) == pytest.approx(0.1)


def test_stale_samples_are_weighed_against_the_policy_that_sampled_them():
    # Tokens sampled by older weights that gave them less probability: the PPO ratio against
    # the behaviour policy is e^1 > 1 + epsilon_high, so every positive-advantage token is clipped.
    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=2)
    trainer = PolicyTrainer(model, _cfg(), total_steps=10, pad_id=tok.pad_token_id)
    group = _group(tok, "7+1=", ["8", "3"], [1.0, 0.0])
    metrics = trainer.grpo_step([_sampled_by(model, group, shift=1.0)])
    assert metrics["ratio_mean"] == pytest.approx(2.718, rel=1e-2)
    assert metrics["clip_frac"] == pytest.approx(0.5)
