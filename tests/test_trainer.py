import copy
import dataclasses
import math

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


def _schedule(total_steps, **train):
    return lr_lambda(config_from_dict({"train": train}).train, total_steps=total_steps)


def test_lr_schedule_is_cosmos_rls_warmup_stable_decay():
    # T = 14, W = 4, D = T - W = 10, stable S = T + 1 - W - D = 1 (the "virtual" step)
    f = _schedule(
        14,
        optm_warmup_steps=4,
        optm_warmup_start_factor=0.2,
        optm_decay_type="cosine",
        optm_min_lr_factor=0.1,
    )
    assert [round(f(s), 4) for s in range(4)] == [0.2, 0.4667, 0.7333, 1.0]
    assert f(4) == 1.0  # stable: s < W + S = 5
    cosine = [0.5 * (1 + math.cos(math.pi * (s + 1 - 5) / 10)) for s in (5, 9, 13)]
    assert [f(s) for s in (5, 9, 13)] == pytest.approx([0.1 + 0.9 * c for c in cosine])
    assert f(13) > 0.1  # the last step stays above the floor


def test_lr_schedule_decay_ratio_fraction_warmup_and_floor_only_in_decay():
    # W = 0.2 * 10 = 2 (a float <= 1 is a fraction), D = round(0.5 * 10) = 5, S = 4
    f = _schedule(
        10,
        optm_warmup_steps=0.2,
        optm_decay_ratio=0.5,
        optm_decay_type="linear",
        optm_min_lr_factor=0.5,
    )
    assert [f(s) for s in range(10)] == pytest.approx(
        [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6]  # 0.5 + 0.5 * (1 - p), p = 0.2 ...
    )
    # No decay type: constant after warm-up, the floor does not apply; one warm-up step is 1.
    f = _schedule(5, optm_warmup_steps=1, optm_min_lr_factor=0.5)
    assert [f(s) for s in range(5)] == [1.0] * 5
    # Warm-up longer than the run is cut to it; sqrt decay.
    f = _schedule(3, optm_warmup_steps=20)
    assert [f(s) for s in range(3)] == [0.0, 0.5, 1.0]
    f = _schedule(4, optm_warmup_steps=0, optm_decay_type="sqrt")
    assert [f(s) for s in range(4)] == pytest.approx(
        [1.0] + [1 - math.sqrt(p / 4) for p in (1, 2, 3)]
    )


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


def test_optm_lr_table_gives_module_prefixes_their_rates():
    model = load_model("tiny:qwen2", seed=0)
    cfg = _cfg()
    cfg.train.optm_lr = {
        "global": 1e-3,
        "model.embed_tokens": 1e-5,
        "model.layers": 1e-4,
        "model.layers.0": 2e-4,  # the longest prefix wins
    }
    trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=0)
    names = {id(p): n for n, p in model.named_parameters()}
    rates = {
        names[id(p)]: group["lr"]
        for group in trainer.optimizer.param_groups
        for p in group["params"]
    }
    assert rates["model.embed_tokens.weight"] == 1e-5
    assert rates["model.layers.0.mlp.up_proj.weight"] == 2e-4
    assert rates["model.layers.3.mlp.up_proj.weight"] == 1e-4
    assert rates["model.norm.weight"] == 1e-3
    assert len(rates) == len(names)
    cfg.train.optm_lr = {"global": 1e-3, "model.layer": 1e-4}  # module paths, not text prefixes
    with pytest.raises(ValueError, match=r"train\.optm_lr: \['model\.layer'\]"):
        PolicyTrainer(load_model("tiny:qwen2", seed=0), cfg, total_steps=10, pad_id=0)


def test_fused_optimizer_on_an_unsupported_device_names_the_key():
    model = load_model("tiny:qwen2", seed=0).to("meta")
    with pytest.raises(ValueError, match=r'train\.optm_impl = "fused"'):
        PolicyTrainer(model, _cfg(), total_steps=1, pad_id=0)
    cfg = _cfg()
    cfg.train.optm_impl = "foreach"
    PolicyTrainer(model, cfg, total_steps=1, pad_id=0)
