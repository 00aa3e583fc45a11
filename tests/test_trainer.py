import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from nebula_rl.config import config_from_dict
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.batching import token_budget_micro_batches
from nebula_rl.policy.setup import apply_trainable, prepare_single_process, use_deterministic
from nebula_rl.policy.trainer import (
    PolicyTrainer,
    collate_groups,
    loss_settings,
    lr_lambda,
    token_logprobs,
)
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
    # by sequences, or by a token budget (max_token_len_per_mini_batch: 2-3 rows of 6-7 tokens)
    for split in ({"mini_batch": 1}, {"mini_batch": 3}, {"max_token_len_per_mini_batch": 14}):
        model = load_model("tiny:qwen2", seed=5)
        cfg = _cfg(variant=variant, loss_type="seq-mean-token-mean", **split)
        trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=tok.pad_token_id)
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
        forwards: list[int] = []

        def count(_, args, kwargs, forwards=forwards):
            # (right-padded rows go without an attention mask: count the tokens that are not
            # padding)
            forwards.append(int((kwargs["input_ids"] != tok.pad_token_id).sum()))

        hook = model.register_forward_pre_hook(count, with_kwargs=True)
        trainer.grpo_step(groups)
        hook.remove()
        if "max_token_len_per_mini_batch" in split:  # forward passes of at most 14 tokens
            assert len(forwards) > 1 and max(forwards) <= 14, forwards
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


def _sgd(trainer):
    """Plain SGD at lr 1 and a constant schedule: updates that add up exactly."""
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    return trainer


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_chunked_logprobs_and_entropy_equal_the_unchunked_computation():
    model = load_model("tiny:qwen2", seed=1)
    x = torch.randint(4, 100, (3, 9))
    mask = (torch.rand(3, 8, generator=torch.Generator().manual_seed(0)) > 0.3).float()
    lp, ent = token_logprobs(
        model,
        x,
        torch.ones_like(x),
        temperature=0.7,
        target_mask=mask,
        with_entropy=True,
        entropy_grad=True,
        chunk_tokens=4,  # mask.sum() = 17 positions: five chunks
    )
    logp_all = F.log_softmax(model(x).logits[:, :-1].float() / 0.7, -1)
    expected_lp = logp_all.gather(-1, x[:, 1:, None]).squeeze(-1) * mask
    expected_ent = -(logp_all.exp() * logp_all).sum(-1) * mask
    torch.testing.assert_close(lp, expected_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, expected_ent, rtol=0, atol=1e-6)
    # Gradients through the checkpointed chunks equal the plain ones.
    weights = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    got = torch.autograd.grad((lp * weights).sum() + ent.sum(), params)
    want = torch.autograd.grad((expected_lp * weights).sum() + expected_ent.sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    # Logged only: the entropy is computed without a graph.
    lp, ent = token_logprobs(
        model, x, torch.ones_like(x), target_mask=mask, with_entropy=True, chunk_tokens=4
    )
    assert lp.requires_grad and ent is not None and not ent.requires_grad


def test_entropy_carries_grad_only_with_an_entropy_coefficient():
    tok = build_char_tokenizer()
    group = _group(tok, "7+1=", ["8", "3"], [1.0, 0.0])
    batch = collate_groups([group], torch.tensor([[1.0, -1.0]]), pad_id=tok.pad_token_id)
    for coef, expected in ((0.0, False), (0.01, True)):
        trainer = PolicyTrainer(
            load_model("tiny:qwen2", seed=2), _cfg(entropy_coeff=coef), total_steps=1, pad_id=0
        )
        logprobs, entropy = trainer.target_logprobs(batch)
        assert logprobs.requires_grad and entropy.requires_grad is expected
        assert (entropy[batch.target_mask == 0] == 0).all()  # only completion tokens
        assert (entropy[batch.target_mask == 1] > 0).all()
        assert trainer.grpo_step([group])["entropy"] > 0  # logged either way


def test_without_rollout_logprobs_for_loss_the_proximal_policy_is_recomputed():
    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=2)
    cfg = _cfg(use_rollout_logprobs_for_loss=False)
    trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=tok.pad_token_id)
    group = _group(tok, "7+1=", ["8", "3"], [1.0, 0.0])
    # Stale rollout log-probs (see the test above) are not read: the ratio starts at 1.
    metrics = trainer.grpo_step([_sampled_by(model, group, shift=1.0)])
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_frac"] == 0.0


def test_completions_without_logprobs_when_they_are_not_collected():
    tok = build_char_tokenizer()
    group = _group(tok, "7+1=", ["8", "3"], [1.0, 0.0])
    bare = dataclasses.replace(
        group, completions=[dataclasses.replace(c, logprobs=[]) for c in group.completions]
    )
    cfg = _cfg(collect_rollout_logprobs=False, use_rollout_logprobs_for_loss=False)
    trainer = PolicyTrainer(load_model("tiny:qwen2", seed=2), cfg, total_steps=2, pad_id=0)
    metrics = trainer.grpo_step([bare])
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    # Where the loss reads them, a completion must carry one per token.
    trainer = PolicyTrainer(load_model("tiny:qwen2", seed=2), _cfg(), total_steps=2, pad_id=0)
    with pytest.raises(ValueError, match=r"collect_rollout_logprobs"):
        trainer.grpo_step([bare])
    # AIPO's weights need them, whatever the variant.
    cfg = _cfg(collect_rollout_logprobs=False, use_rollout_logprobs_for_loss=False, aipo_rho=2.0)
    trainer = PolicyTrainer(load_model("tiny:qwen2", seed=2), cfg, total_steps=2, pad_id=0)
    with pytest.raises(ValueError, match=r"train\.train_policy\.aipo_rho"):
        trainer.grpo_step([bare])


def test_aipo_rho_makes_a_grpo_step_aipo():
    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=2)
    group = _sampled_by(model, _group(tok, "7+1=", ["8", "3"], [1.0, 0.0]), shift=-2.0)
    for variant in ("grpo", "dapo"):
        trainer = PolicyTrainer(
            copy.deepcopy(model), _cfg(variant=variant, aipo_rho=2.0), total_steps=2, pad_id=0
        )
        metrics = trainer.grpo_step([group])
        # behaviour log-probs 2 above the policy's: weight e^-2 < rho, none truncated
        assert metrics["truncated_frac"] == 0.0
        assert metrics["behaviour_weight_mean"] == pytest.approx(math.exp(-2.0), rel=1e-4)


def test_batch_size_per_optimize_takes_one_update_per_slice():
    tok = build_char_tokenizer()
    groups = [
        _group(tok, "2+2=", ["4", "22", "5", "0"], [1.0, 0.0, 0.0, 1.0]),
        _group(tok, "3+4=", ["7", "1", "34", "77"], [1.0, 0.0, 0.0, 0.0]),
    ]
    sliced = _sgd(
        PolicyTrainer(
            load_model("tiny:qwen2", seed=5),
            _cfg(batch_size_per_optimize=4, mini_batch=3),
            total_steps=10,
            pad_id=tok.pad_token_id,
        )
    )
    updates = []
    sliced.optimizer.register_step_post_hook(lambda *_: updates.append(1))
    sliced.grpo_step(groups)
    assert len(updates) == sliced.planned_updates == 2
    assert sliced.scheduler.last_epoch == 1  # the schedule steps once per training step
    # Each slice is its own update with its own counts: as two steps, one per group.
    stepwise = _sgd(
        PolicyTrainer(load_model("tiny:qwen2", seed=5), _cfg(), total_steps=10, pad_id=0)
    )
    for group in groups:
        stepwise.grpo_step([group])
    torch.testing.assert_close(_params(sliced.model), _params(stepwise.model), rtol=0, atol=1e-6)
    # mu_iterations passes: every slice once per pass.
    trainer = PolicyTrainer(
        load_model("tiny:qwen2", seed=5),
        _cfg(batch_size_per_optimize=3, mu_iterations=2),
        total_steps=10,
        pad_id=0,
    )
    trainer.grpo_step(groups)
    assert trainer.planned_updates == 3 * 2


def test_token_budget_micro_batches_are_balanced_and_within_budget():
    lengths = [9, 1, 7, 3, 3, 6]
    # ceil(29 / 10) = 3 micro-batches, longest first into the least filled: 9+1, 7+3, 6+3
    assert token_budget_micro_batches(lengths, max_tokens=10) == [[0, 1], [2, 4], [3, 5]]
    # [9, 2, 7, 3, 3, 6] has no 3-way split within 10 (9 needs a 1): LPT overflows, so 4
    parts = token_budget_micro_batches([9, 2, 7, 3, 3, 6], max_tokens=10)
    assert parts == [[0], [1, 5], [2], [3, 4]]
    assert token_budget_micro_batches([6, 6, 6], max_tokens=10) == [[0], [1], [2]]
    # a budget below the longest sequence is raised to it
    assert token_budget_micro_batches([8, 3], max_tokens=4) == [[0], [1]]
    assert token_budget_micro_batches([8, 3], max_tokens=11) == [[0, 1]]


def test_reference_reset_takes_the_current_weights_and_clears_the_moments():
    tok = build_char_tokenizer()
    group = _group(tok, "5+5=", ["10", "11"], [1.0, 0.0])
    for reset_optimizer in (True, False):
        model = load_model("tiny:qwen2", seed=2)
        ref = copy.deepcopy(model).requires_grad_(False)
        cfg = _cfg(
            kl_beta=0.1,
            reference_reset_interval=2,
            reset_optimizer_with_reference=reset_optimizer,
        )
        cfg.train.optm_warmup_steps, cfg.train.optm_warmup_start_factor = 4, 0.5
        trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=0, ref_model=ref)
        trainer.grpo_step([group])
        assert not torch.equal(_params(ref), _params(model))
        assert len(trainer.optimizer.state) > 0
        metrics = trainer.grpo_step([group])
        assert torch.equal(_params(ref), _params(model))  # step 2: the reference is reset
        assert (len(trainer.optimizer.state) == 0) is reset_optimizer
        # the schedule keeps its place: 0.5 + 0.5 * 2 / 3 of the peak for the third step
        assert metrics["lr"] == pytest.approx(1e-3 * (0.5 + 0.5 * 2 / 3))
        assert trainer.grpo_step([group])["kl"] == pytest.approx(0.0, abs=1e-6)


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


def test_trainable_patterns_and_map_set_what_trains():
    def policy(**keys):
        return config_from_dict({"policy": keys}).policy

    model = load_model("tiny:qwen2", seed=0)
    apply_trainable(model, policy(freeze_pattern=[r"^model\.embed_tokens\.", r"layers\.[01]\."]))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "model.embed_tokens.weight" in frozen and "model.layers.1.mlp.up_proj.weight" in frozen
    assert not any(n.startswith(("model.layers.2.", "model.norm")) for n in frozen)

    model = load_model("tiny:qwen2", seed=0)
    apply_trainable(
        model,
        policy(
            trainable_pattern=[r"mlp"],
            trainable_map={"model.layers.3.mlp": False, "model.norm.weight": True},
        ),
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"model.layers.{i}.mlp.{m}.weight"
        for i in range(3)
        for m in ("gate_proj", "up_proj", "down_proj")
    } | {"model.norm.weight"}
    # The optimiser takes the trainable parameters only; a step leaves the others alone.
    trainer = PolicyTrainer(model, _cfg(), total_steps=2, pad_id=0)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tok = build_char_tokenizer()
    trainer.grpo_step([_group(tok, "7+1=", ["8", "3"], [1.0, 0.0])])
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) is (name not in trainable), name

    for keys, key in (
        ({"freeze_pattern": ["nothing_like_this"]}, "policy.freeze_pattern"),
        ({"trainable_pattern": ["mlp", "^vision"]}, "policy.trainable_pattern"),
        ({"trainable_map": {"model.layers.9": True}}, "policy.trainable_map"),
        ({"trainable_pattern": ["["]}, "policy.trainable_pattern"),
        ({"freeze_pattern": ["."]}, "leave no parameter"),
    ):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            apply_trainable(load_model("tiny:qwen2", seed=0), policy(**keys))


def _sft_cfg(**train):
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                **train,
                "train_policy": {"type": "sft", "mini_batch": 4},
            },
            "policy": {"model_gradient_checkpointing": train.pop("checkpointing", False)},
        }
    )


def _sft_examples():
    from nebula_rl.data import sft_example

    tok = build_char_tokenizer()
    return [
        sft_example(
            tok,
            [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": f"{i + 1}"}],
        )
        for i in range(6)
    ]


def _prepared_sft_step(cfg):
    model = load_model("tiny:qwen2", seed=4)
    prepare_single_process(model, cfg)
    trainer = PolicyTrainer(model, cfg, total_steps=3, pad_id=0)
    losses = [trainer.sft_step(_sft_examples())["loss"] for _ in range(2)]
    return model, losses


def test_activation_checkpointing_recomputes_and_steps_like_plain():
    plain, plain_losses = _prepared_sft_step(_sft_cfg())
    cfg = config_from_dict(
        {
            "train": {
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "train_policy": {"type": "sft", "mini_batch": 4},
            },
            "policy": {"model_gradient_checkpointing": True},
        }
    )
    model = load_model("tiny:qwen2", seed=4)
    prepare_single_process(model, cfg)
    calls = []
    # (a pre-hook: the recomputation stops as soon as it has what backward needs, inside mlp)
    model.model.layers[1].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    trainer = PolicyTrainer(model, cfg, total_steps=3, pad_id=0)
    losses = [trainer.sft_step(_sft_examples())["loss"] for _ in range(2)]
    # 2 steps x 2 micro-batches, each layer forward run again in backward
    assert len(calls) == 2 * 2 * 2
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    torch.testing.assert_close(_params(model), _params(plain), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compiled_blocks_step_like_plain():
    plain, plain_losses = _prepared_sft_step(_sft_cfg())
    compiled, losses = _prepared_sft_step(_sft_cfg(compile=True))
    assert compiled.model.layers[0]._compiled_call_impl is not None
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    torch.testing.assert_close(_params(compiled), _params(plain), rtol=0, atol=1e-5)


def test_deterministic_switches_torch_to_deterministic_kernels():
    assert not torch.are_deterministic_algorithms_enabled()
    use_deterministic(_cfg().train)  # off: nothing changes
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        cfg = _cfg()
        cfg.train.deterministic = True
        use_deterministic(cfg.train)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_positive_nll_is_added_to_the_update_and_reported_apart():
    tok = build_char_tokenizer()
    group = _group(tok, "7+1=", ["8", "3", "52"], [1.0, 0.0, 0.5])
    model = load_model("tiny:qwen2", seed=2)
    # token mean of -log p over the completion tokens of the positive-reward samples
    positive = [("8", 2), ("52", 3)]
    expected = -sum(_logp_of(model, tok, "7+1=", a) for a, _ in positive) / 5
    runs = {}
    for coef in (None, 0.5):
        trainer = _sgd(
            PolicyTrainer(
                copy.deepcopy(model), _cfg(positive_nll_coef=coef), total_steps=2, pad_id=0
            )
        )
        runs[coef] = (trainer.grpo_step([group]), _params(trainer.model))
    assert runs[0.5][0]["positive_nll"] == pytest.approx(expected, rel=1e-5)
    assert "positive_nll" not in runs[None][0]
    assert runs[0.5][0]["loss"] == pytest.approx(runs[None][0]["loss"], rel=1e-6)  # not in `loss`
    assert not torch.allclose(runs[0.5][1], runs[None][1])


def test_shared_prefixes_are_left_out_of_the_loss_mask():
    tok = build_char_tokenizer()
    group = _group(tok, "1+1=", ["2222", "2223", "9"], [1.0, 0.0, 0.0])
    advantages = torch.zeros(1, 3)
    plain = collate_groups([group], advantages, pad_id=0)
    masked = collate_groups(
        [group],
        advantages,
        pad_id=0,
        min_filter_prefix_tokens=2,
        eos_token_ids=[tok.eos_token_id],
    )
    # "222" is shared by the first two, whose rewards differ: their first 3 tokens go.
    assert plain.target_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert masked.target_mask[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert masked.target_mask[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert torch.equal(masked.target_mask[2], plain.target_mask[2])
    trainer = PolicyTrainer(
        load_model("tiny:qwen2", seed=2), _cfg(min_filter_prefix_tokens=2), total_steps=2, pad_id=0
    )
    assert trainer.grpo_step([group])["num_tokens"] == float(plain.target_mask.sum()) - 6


def test_loss_settings_choose_the_dr_grpo_constant():
    def settings(**policy):
        return loss_settings(
            config_from_dict(
                {
                    "train": {"train_policy": {"type": "grpo", **policy}},
                    "rollout": {"max_response_length": 300},
                }
            )
        )

    assert settings(loss_type="seq-mean-token-mean").max_tokens is None
    assert settings(loss_type="seq-mean-token-mean", unbiased_loss_max_tokens=100).max_tokens == 100
    assert settings(loss_type="seq-mean-token-sum-norm").max_tokens == 300
    assert (
        settings(loss_type="seq-mean-token-sum-norm", unbiased_loss_max_tokens=50).max_tokens == 50
    )
    s = settings(advantage_low=-1.0, advantage_high=2.0, unbiased_kl_estimate=True,
                 off_policy_masking_delta=0.3)  # fmt: skip
    assert (s.advantage_low, s.advantage_high, s.unbiased_kl_estimate, s.off_policy_masking_delta) == (
        -1.0, 2.0, True, 0.3
    )  # fmt: skip
