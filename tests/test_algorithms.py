"""Every algorithm formula against a hand computation on small tensors (CPU, fast)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from nebula_rl.algorithms import (
    ALGORITHMS,
    IGNORE_INDEX,
    LOSS_TYPES,
    LossSettings,
    PolicyBatch,
    aggregate,
    aipo_loss,
    aipo_weight,
    decoupled_weight,
    dynamic_sampling_filter,
    get_algorithm,
    group_advantages,
    grpo_advantages,
    grpo_loss,
    gspo_loss,
    gspo_token_ratio,
    importance_weighted_k3_kl,
    k3_kl,
    off_policy_sequence_mask,
    policy_loss,
    positive_nll,
    ppo_clip_loss,
    sft_loss,
    sft_loss_from_logprobs,
    sft_num_tokens,
    shared_prefix_lengths,
)

EPS = 1e-6  # GRPO's std epsilon


def close(actual: torch.Tensor | float, expected: float, tol: float = 1e-5) -> bool:
    return math.isclose(
        float(actual.detach()) if isinstance(actual, torch.Tensor) else actual,
        expected,
        rel_tol=tol,
        abs_tol=tol,
    )


def assert_values(actual: torch.Tensor, expected: list, tol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.detach(), torch.tensor(expected, dtype=actual.dtype), rtol=tol, atol=tol
    )


def make_batch(
    logprobs: list[list[float]],
    old_logprobs: list[list[float]],
    advantages: list[float],
    mask: list[list[float]],
    **optional: list[list[float]],
) -> PolicyBatch:
    extra = {name: torch.tensor(value) for name, value in optional.items()}
    return PolicyBatch(
        logprobs=torch.tensor(logprobs, requires_grad=True),
        old_logprobs=torch.tensor(old_logprobs),
        advantages=torch.tensor(advantages),
        mask=torch.tensor(mask),
        **extra,
    )


# --- GRPO advantages ---------------------------------------------------------------------------


def test_grpo_advantages_match_hand_computation() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    std1 = math.sqrt(4 * 0.25 / 3)  # unbiased: mean 0.5
    std2 = math.sqrt((9 + 1 + 1 + 9) / 3)  # mean 5
    expected = [
        [0.5 / (std1 + EPS), -0.5 / (std1 + EPS), -0.5 / (std1 + EPS), 0.5 / (std1 + EPS)],
        [d / (std2 + EPS) for d in (-3.0, -1.0, 1.0, 3.0)],
    ]
    advantages = grpo_advantages(rewards)
    for row, expected_row in zip(advantages.tolist(), expected, strict=True):
        for value, want in zip(row, expected_row, strict=True):
            assert close(value, want)


def test_grpo_advantages_without_std_are_centred_rewards() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    advantages = grpo_advantages(rewards, normalize_std=False)
    expected = [[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 1.0, 3.0]]
    for row, expected_row in zip(advantages.tolist(), expected, strict=True):
        for value, want in zip(row, expected_row, strict=True):
            assert close(value, want)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_advantages_of_equal_rewards_are_exactly_zero(normalize_std: bool) -> None:
    # 0.1 is not representable; its float mean can differ from the elements by an ulp.
    rewards = torch.tensor([[0.1] * 7, [1.0] * 7, [0.0] * 7, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    advantages = grpo_advantages(rewards, normalize_std=normalize_std)
    assert torch.isfinite(advantages).all()
    assert (advantages[:3] == 0).all()
    assert (advantages[3] != 0).all()


def test_grpo_advantages_reject_groups_of_one() -> None:
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.tensor([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


# --- PPO clip, dual clip -----------------------------------------------------------------------


def test_ppo_clip_asymmetric_without_dual_clip() -> None:
    ratios = [0.5, 0.9, 1.0, 1.3, 5.0]
    ratio = torch.tensor([ratios, ratios])
    advantages = torch.tensor([[1.0], [-1.0]])
    loss, clipped = ppo_clip_loss(
        ratio, advantages, epsilon_low=0.2, epsilon_high=0.28, lower_bound_ratio=None
    )
    # A > 0: -min(r, clip(r)); A < 0: max(r, clip(r)) with clip to [0.8, 1.28].
    expected = [[-0.5, -0.9, -1.0, -1.28, -1.28], [0.8, 0.9, 1.0, 1.3, 5.0]]
    for row, expected_row in zip(loss.tolist(), expected, strict=True):
        for value, want in zip(row, expected_row, strict=True):
            assert close(value, want)
    assert clipped.tolist() == [
        [False, False, False, True, True],
        [True, False, False, False, False],
    ]


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    ratio = torch.tensor([[0.5, 2.0, 5.0], [0.5, 2.0, 5.0], [0.5, 2.0, 5.0]])
    advantages = torch.tensor([[-1.0], [-2.0], [1.0]])
    loss, clipped = ppo_clip_loss(
        ratio, advantages, epsilon_low=0.2, epsilon_high=0.2, lower_bound_ratio=3.0
    )
    # A = -1: max(r, clip(r)) = 0.8, 2, 5 -> 5 bounded by 3 * 1 = 3.
    # A = -2: 1.6, 4, 10 -> 10 bounded by 3 * 2 = 6. A > 0 is untouched: -0.5, -1.2, -1.2.
    expected = [[0.8, 2.0, 3.0], [1.6, 4.0, 6.0], [-0.5, -1.2, -1.2]]
    for row, expected_row in zip(loss.tolist(), expected, strict=True):
        for value, want in zip(row, expected_row, strict=True):
            assert close(value, want)
    assert clipped.tolist() == [[True, False, True], [True, False, True], [False, True, True]]


def test_negative_epsilon_disables_the_clip_on_its_side() -> None:
    ratio = torch.tensor([[0.5, 1.5, 5.0], [0.5, 1.5, 5.0]])
    advantages = torch.tensor([[1.0], [-1.0]])
    # No lower clip: A < 0 at r = 0.5 keeps 0.5 (not 0.8); the upper clip 1.2 still applies.
    loss, clipped = ppo_clip_loss(
        ratio, advantages, epsilon_low=-1.0, epsilon_high=0.2, lower_bound_ratio=None
    )
    assert_values(loss, [[-0.5, -1.2, -1.2], [0.5, 1.5, 5.0]])
    assert clipped.tolist() == [[False, True, True], [False, False, False]]
    # No upper clip: A > 0 at r = 1.5, 5 keeps r; the lower clip 0.8 applies to A < 0.
    loss, _ = ppo_clip_loss(
        ratio, advantages, epsilon_low=0.2, epsilon_high=-1.0, lower_bound_ratio=None
    )
    assert_values(loss, [[-0.5, -1.5, -5.0], [0.8, 1.5, 5.0]])
    # Both off: the plain surrogate -A * r, but the dual clip still caps A < 0 at 3 * |A|.
    loss, clipped = ppo_clip_loss(
        ratio, advantages, epsilon_low=-1.0, epsilon_high=-1.0, lower_bound_ratio=3.0
    )
    assert_values(loss, [[-0.5, -1.5, -5.0], [0.5, 1.5, 3.0]])
    assert clipped.tolist() == [[False, False, False], [False, False, True]]


def test_clipped_tokens_get_zero_gradient() -> None:
    log_ratio = torch.tensor([[math.log(1.1), math.log(1.5), math.log(0.5), math.log(5.0)]])
    log_ratio.requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, _ = ppo_clip_loss(
        log_ratio.exp(), advantages, epsilon_low=0.2, epsilon_high=0.2, lower_bound_ratio=3.0
    )
    loss.sum().backward()
    # d/dlog r of -A * r is -A * r where unclipped; 0 where the clip (1.5, 0.5) or dual clip (5).
    assert log_ratio.grad is not None
    for value, want in zip(log_ratio.grad[0].tolist(), [-1.1, 0.0, 0.0, 0.0], strict=True):
        assert close(value, want)


# --- aggregation -------------------------------------------------------------------------------


AGG_VALUES = [[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0]]
AGG_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("loss_type", "max_tokens", "expected"),
    [
        ("token-mean", None, (6 + 4) / 10),  # global num_tokens = 10
        ("token-sum", None, 6 + 4),  # no denominator
        ("seq-mean-token-sum", None, (6 + 4 + 0) / 5),  # global num_sequences = 5
        ("seq-mean-token-mean", None, (6 / 3 + 4 / 1 + 0) / 5),
        ("seq-mean-token-mean", 8, (6 / 8 + 4 / 8 + 0) / 5),  # Dr.GRPO's constant
        ("seq-mean-token-sum-norm", 8, (6 / 8 + 4 / 8 + 0) / 5),
    ],
)
def test_aggregate_uses_the_given_denominators(
    loss_type: str, max_tokens: int | None, expected: float
) -> None:
    result = aggregate(
        torch.tensor(AGG_VALUES),
        torch.tensor(AGG_MASK),
        loss_type=loss_type,
        num_tokens=10,
        num_sequences=5,
        max_tokens=max_tokens,
    )
    assert close(result, expected)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_over_micro_batches_sums_to_the_full_batch(loss_type: str) -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.4).float()
    mask[2] = 0.0  # one empty sequence
    kwargs = dict(
        loss_type=loss_type,
        num_tokens=float(mask.sum()),
        num_sequences=6.0,
        max_tokens=5 if loss_type == "seq-mean-token-sum-norm" else None,
    )
    full = aggregate(values, mask, **kwargs)
    split = aggregate(values[:2], mask[:2], **kwargs) + aggregate(values[2:], mask[2:], **kwargs)
    assert close(split, float(full))
    # and against a plain-python evaluation of the definition
    rows = [(v, m) for v, m in zip(values.tolist(), mask.tolist(), strict=True)]
    sums = [sum(x * w for x, w in zip(v, m, strict=True)) for v, m in rows]
    counts = [sum(m) for _, m in rows]
    expected = {
        "token-mean": sum(sums) / sum(counts),
        "token-sum": sum(sums),
        "seq-mean-token-sum": sum(sums) / 6,
        "seq-mean-token-mean": sum(s / c for s, c in zip(sums, counts, strict=True) if c) / 6,
        "seq-mean-token-sum-norm": sum(s / 5 for s in sums) / 6,
    }[loss_type]
    assert close(full, expected)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_of_empty_masks_is_zero_with_finite_gradient(loss_type: str) -> None:
    values = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    result = aggregate(
        values, mask, loss_type=loss_type, num_tokens=0, num_sequences=0, max_tokens=4
    )
    result.backward()
    assert float(result.detach()) == 0.0
    assert values.grad is not None and (values.grad == 0).all()


def test_aggregate_rejects_bad_loss_type_and_missing_max_tokens() -> None:
    values, mask = torch.ones(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(values, mask, loss_type="mean", num_tokens=2, num_sequences=1)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(values, mask, loss_type="seq-mean-token-sum-norm", num_tokens=2, num_sequences=1)


def test_loss_settings_reject_invalid_values() -> None:
    LossSettings()  # the defaults are valid
    LossSettings(epsilon_low=-1.0, epsilon_high=-1.0)  # negative ranges disable the clip
    for bad in (
        {"advantage_low": 1.0, "advantage_high": 0.5},
        {"lower_bound_ratio": 0.5},
        {"loss_type": "sum"},
        {"loss_type": "seq-mean-token-sum-norm"},
        {"aipo_rho": 0.0},
        {"behaviour_weight_cap": -1.0},
    ):
        with pytest.raises(ValueError, match=r"train\.train_policy\."):
            LossSettings(**bad)


def test_advantages_are_clipped_to_the_configured_range() -> None:
    rewards = torch.tensor([[0.0, 0.0, 0.0, 10.0]])
    settings = LossSettings(normalize_std=False, advantage_low=-2.0, advantage_high=4.0)
    # centred: -2.5, -2.5, -2.5, 7.5 -> clipped to [-2, 4]
    assert_values(group_advantages(rewards, settings), [[-2.0, -2.0, -2.0, 4.0]])


def test_token_sum_loss_is_the_plain_sum() -> None:
    batch = make_batch([[-1.0, -2.0], [-0.5, -0.5]], [[-1.0, -2.0], [-0.5, -0.5]], [2.0, -1.0],
                       [[1.0, 1.0], [1.0, 0.0]])  # fmt: skip
    loss, _ = grpo_loss(batch, LossSettings(loss_type="token-sum"), num_tokens=3, num_sequences=2)
    assert close(loss, -2.0 * 2 + 1.0 * 1)  # ratio 1 everywhere: sum of -A over tokens
    loss.backward()
    assert batch.logprobs.grad is not None
    assert_values(batch.logprobs.grad, [[-2.0, -2.0], [1.0, 0.0]])


# --- AIPO whenever aipo_rho is set -------------------------------------------------------------


def test_aipo_rho_makes_every_token_ratio_variant_aipo() -> None:
    for variant in ("grpo", "dapo", "aipo"):
        assert policy_loss(variant, LossSettings(aipo_rho=2.0)) is aipo_loss
    assert policy_loss("grpo", LossSettings()) is grpo_loss
    assert policy_loss("dapo", LossSettings()) is grpo_loss
    assert policy_loss("gspo", LossSettings()) is gspo_loss


# --- VAPO positive-example NLL -----------------------------------------------------------------


def test_positive_nll_averages_the_positive_samples_tokens() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.7, -0.1], [-3.0, -3.0, -3.0]])
    logprobs.requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    positive = torch.tensor([True, False, True])
    # positive tokens: -1, -2 (row 0), -3 x 3 (row 2); the global count is 7 (another rank's 2)
    nll = positive_nll(logprobs, mask, positive, num_tokens=7)
    assert close(nll, (1.0 + 2.0 + 9.0) / 7)
    nll.backward()
    assert logprobs.grad is not None
    assert_values(logprobs.grad, [[-1 / 7, -1 / 7, 0.0], [0.0, 0.0, 0.0], [-1 / 7] * 3])


# --- DeepSeek-V3.2: unbiased KL, off-policy sequence masking -----------------------------------


def test_importance_weighted_kl_matches_hand_computation() -> None:
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    old = torch.tensor([-1.2, -2.0])
    kl = importance_weighted_k3_kl(logprobs, ref, old)
    # weights exp(-1 + 1.2) = e^0.2 and 1; k3 with d = ref - logp = -0.5 and 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]
    assert_values(kl, [math.exp(0.2) * k3[0], k3[1]])
    kl.sum().backward()
    # d/dlogp of w(logp) * k3(logp) = w * k3 + w * (1 - exp(d)): the weight carries gradient
    grads = [math.exp(0.2) * (k3[0] + 1 - math.exp(-0.5)), k3[1] + 1 - math.exp(1.0)]
    assert logprobs.grad is not None
    assert_values(logprobs.grad, grads)


def test_unbiased_kl_estimate_enters_the_loss() -> None:
    kwargs = dict(
        logprobs=[[-1.0, -2.0]],
        old_logprobs=[[-1.2, -2.0]],
        advantages=[0.0],
        mask=[[1.0, 1.0]],
        ref_logprobs=[[-1.5, -1.0]],
    )
    settings = LossSettings(kl_beta=0.5, unbiased_kl_estimate=True)
    loss, metrics = grpo_loss(make_batch(**kwargs), settings, num_tokens=2, num_sequences=1)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]
    kl = (math.exp(0.2) * k3[0] + k3[1]) / 2
    assert close(metrics["kl"], kl)
    assert close(loss, 0.5 * kl)  # A = 0: no policy loss


def test_off_policy_sequence_mask_drops_stale_negative_sequences() -> None:
    logprobs = torch.tensor([[-2.0, -2.0, 0.0], [-2.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.5, 5.0], [-1.0, -1.5, 5.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # mean(old - logp) over the masked tokens: (1 + 0.5) / 2 = 0.75, 0.75, 0
    keep = off_policy_sequence_mask(logprobs, old, torch.tensor([-1.0, 1.0, -1.0]), mask, delta=0.5)
    assert keep.tolist() == [0.0, 1.0, 1.0]  # only the negative-advantage stale one goes
    keep = off_policy_sequence_mask(
        logprobs, old, torch.tensor([-1.0, 1.0, -1.0]), mask, delta=0.75
    )
    assert keep.tolist() == [1.0, 1.0, 1.0]  # not above delta


def test_off_policy_masking_removes_the_sequence_from_the_policy_loss() -> None:
    batch = make_batch(
        [[-2.0, -2.0], [-1.0, -1.0]], [[-1.0, -1.0], [-1.0, -1.0]], [-1.0, 1.0],
        [[1.0, 1.0], [1.0, 1.0]],
    )  # fmt: skip
    settings = LossSettings(
        off_policy_masking_delta=0.5, epsilon_low=-1, epsilon_high=-1, lower_bound_ratio=None
    )
    loss, metrics = grpo_loss(batch, settings, num_tokens=4, num_sequences=2)
    assert close(loss, (-1.0 * 2) / 4)  # only the second sequence: -A * r = -1 per token
    assert close(metrics["off_policy_masked_frac"], 0.5)
    loss.backward()
    assert batch.logprobs.grad is not None
    assert_values(batch.logprobs.grad, [[0.0, 0.0], [-0.25, -0.25]])


# --- shared-prefix filter (min_filter_prefix_tokens) -------------------------------------------


def test_shared_prefixes_with_different_rewards_are_skipped() -> None:
    eos = 0
    completions = [
        [1, 2, 3, 4, 5, eos],  # shares [1, 2, 3, 4] with the next one (depth 4 node, maximal)
        [1, 2, 3, 4, 6, eos],
        [1, 2, 7, eos],  # shares only [1, 2] with them: shorter than min_tokens = 3
        [8, 9, 9, eos],  # shares [8, 9, 9] with the next one, but their rewards are equal
        [8, 9, 9, 5],
        [4, 4, 4, eos],  # shares [4, 4, 4] ...
        [4, 4, 4, 4, eos],  # ... with this one, reward differs
    ]
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    skips = shared_prefix_lengths(completions, rewards, min_tokens=3, eos_token_ids=[eos])
    # [4, 4, 4, eos] is nothing but the shared prefix [4, 4, 4] (and its end): it keeps its
    # tokens, as in cosmos-rl, which compares the decoded texts.
    assert skips == [4, 4, 0, 0, 0, 0, 3]
    # With a longer minimum the [4, 4, 4] and [1, 2, 3, 4] prefixes no longer count.
    assert shared_prefix_lengths(completions, rewards, min_tokens=5) == [0] * 7


def test_only_the_deepest_shared_prefix_counts() -> None:
    # [1, 2, 3] is shared by all three, but two of them continue together to [1, 2, 3, 4]: the
    # trie node [1, 2, 3] has a child with two sequences, so it is not a maximal group, and the
    # third completion (which leaves it alone) keeps its tokens, as in cosmos-rl.
    completions = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 9]]
    assert shared_prefix_lengths(completions, [1.0, 0.0, 0.5], min_tokens=2) == [4, 4, 0]
    assert shared_prefix_lengths(completions, [1.0, 1.0, 0.0], min_tokens=2) == [0, 0, 0]


# --- KL and entropy ----------------------------------------------------------------------------


def test_k3_kl_matches_hand_computation() -> None:
    kl = k3_kl(torch.tensor([-1.0, -2.0, -0.7]), torch.tensor([-1.5, -1.0, -0.7]))
    # d = ref - logp = -0.5, 1.0, 0.0
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]
    for value, want in zip(kl.tolist(), expected, strict=True):
        assert close(value, want)


def test_kl_penalty_is_added_with_kl_beta() -> None:
    kwargs = dict(
        logprobs=[[-1.0, -2.0]],
        old_logprobs=[[-1.0, -2.0]],
        advantages=[0.5],
        mask=[[1.0, 1.0]],
        ref_logprobs=[[-1.5, -1.0]],
    )
    settings = LossSettings(kl_beta=0.1)
    loss, metrics = grpo_loss(make_batch(**kwargs), settings, num_tokens=4, num_sequences=1)
    kl = (math.exp(-0.5) + 0.5 - 1 + math.exp(1.0) - 2) / 4
    pg = -0.5 * 2 / 4  # ratio 1 on both tokens
    assert close(metrics["kl"], kl)
    assert close(loss, pg + 0.1 * kl)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kwargs.pop("ref_logprobs")
        grpo_loss(make_batch(**kwargs), settings, num_tokens=4, num_sequences=1)


def test_entropy_bonus_carries_gradient() -> None:
    entropy = torch.tensor([[0.5, 1.5, 9.0]], requires_grad=True)
    batch = PolicyBatch(
        logprobs=torch.zeros(1, 3, requires_grad=True),
        old_logprobs=torch.zeros(1, 3),
        advantages=torch.zeros(1),
        mask=torch.tensor([[1.0, 1.0, 0.0]]),
        entropy=entropy,
    )
    settings = LossSettings(entropy_coef=0.01)
    loss, metrics = grpo_loss(batch, settings, num_tokens=4, num_sequences=1)
    assert close(metrics["entropy"], 2.0 / 4)
    assert close(loss, -0.01 * 2.0 / 4)
    loss.backward()
    assert entropy.grad is not None
    for value, want in zip(entropy.grad[0].tolist(), [-0.01 / 4, -0.01 / 4, 0.0], strict=True):
        assert close(value, want)
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(dataclasses.replace(batch, entropy=None), settings, num_tokens=4, num_sequences=1)


# --- GRPO / DAPO loss --------------------------------------------------------------------------


def test_grpo_loss_matches_hand_computation() -> None:
    logprobs = [[-1.0, -0.5, -2.0], [-0.2, -3.0, -1.0]]
    old = [[-1.1, -0.9, -2.0], [-0.1, -2.0, -1.0]]
    advantages = [1.0, -0.5]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    batch = make_batch(logprobs, old, advantages, mask)
    settings = LossSettings(epsilon_low=0.2, epsilon_high=0.28, lower_bound_ratio=3.0)
    loss, metrics = grpo_loss(batch, settings, num_tokens=5, num_sequences=2)

    total, clipped, ratio_sum = 0.0, 0, 0.0
    for lp_row, old_row, a, m_row in zip(logprobs, old, advantages, mask, strict=True):
        for lp, o, m in zip(lp_row, old_row, m_row, strict=True):
            if not m:
                continue
            r = math.exp(lp - o)
            token = max(-a * r, -a * min(max(r, 0.8), 1.28))
            clipped += -a * min(max(r, 0.8), 1.28) > -a * r
            total += token
            ratio_sum += r
    assert close(loss, total / 5)
    assert close(metrics["clip_frac"], clipped / 5)
    assert clipped == 2  # r = e^0.4 clipped for A > 0, r = e^-1 clipped for A < 0
    assert close(metrics["ratio_mean"], ratio_sum / 5)
    assert all(not value.requires_grad for value in metrics.values())


def test_on_policy_grpo_gradient_is_the_policy_gradient() -> None:
    batch = make_batch(
        [[-1.0, -2.0], [-0.3, -0.4]],
        [[-1.0, -2.0], [-0.3, -0.4]],
        [2.0, -1.0],
        [[1.0, 1.0], [1.0, 0.0]],
    )
    loss, _ = grpo_loss(batch, LossSettings(), num_tokens=3, num_sequences=2)
    loss.backward()
    assert batch.logprobs.grad is not None
    assert_values(batch.logprobs.grad, [[-2 / 3, -2 / 3], [1 / 3, 0.0]])


def test_decoupled_weight_and_cap() -> None:
    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    behaviour = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)]])
    assert_values(decoupled_weight(old, behaviour, cap=None), [[2.0, 0.5, 9.0]])
    # AReaL semantics: weights above the cap drop the token, they are not truncated to the cap.
    assert_values(decoupled_weight(old, behaviour, cap=5.0), [[2.0, 0.5, 0.0]])


def test_grpo_loss_is_weighted_by_the_behaviour_policy() -> None:
    old = [[math.log(0.5), math.log(0.2), math.log(0.9)]]
    behaviour = [[math.log(0.25), math.log(0.4), math.log(0.1)]]
    logprobs = [[math.log(0.5), math.log(0.2) + 0.5, math.log(0.9)]]
    batch = make_batch(logprobs, old, [1.0], [[1.0, 1.0, 1.0]], behaviour_logprobs=behaviour)
    settings = LossSettings(behaviour_weight_cap=5.0)
    loss, metrics = grpo_loss(batch, settings, num_tokens=3, num_sequences=1)
    # ratios 1, e^0.5 (clipped to 1.2), 1; weights 2, 0.5, 0 (above the cap)
    assert close(loss, (2.0 * -1.0 + 0.5 * -1.2 + 0.0) / 3)
    assert close(metrics["behaviour_weight_mean"], 2.5 / 3)
    loss.backward()
    assert batch.logprobs.grad is not None
    assert_values(batch.logprobs.grad, [[-2.0 / 3, 0.0, 0.0]])


# --- GSPO --------------------------------------------------------------------------------------


def test_gspo_ratio_is_the_geometric_mean_on_every_token() -> None:
    logprobs = torch.tensor([[0.1, -0.3, 7.0], [0.0, 0.0, 0.0]])
    ratio = gspo_token_ratio(logprobs, torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 0.0]] * 2))
    assert_values(ratio, [[math.exp(-0.1)] * 3, [1.0] * 3])


def test_gspo_token_gradient_equals_the_sequence_form() -> None:
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=generator)
    logprobs = (old + 0.05 * torch.randn(3, 5, generator=generator)).requires_grad_(True)
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0], [0.0] * 5])
    advantages = torch.tensor([1.0, -0.7, 0.3])
    settings = LossSettings(
        epsilon_low=0.5, epsilon_high=0.5, lower_bound_ratio=None, loss_type="seq-mean-token-mean"
    )
    batch = PolicyBatch(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask)
    loss, _ = gspo_loss(batch, settings, num_tokens=8, num_sequences=3)
    (token_grad,) = torch.autograd.grad(loss, logprobs)

    # sequence form: -(1/G) sum_i A_i exp(mean_t (logp - old)), no clip active
    # over the sequences that have tokens (the empty third one contributes nothing)
    lengths = mask.sum(-1).clamp(min=1)
    s = torch.exp(((logprobs - old) * mask).sum(-1) / lengths)
    sequence_loss = -(advantages * s)[:2].sum() / 3
    (sequence_grad,) = torch.autograd.grad(sequence_loss, logprobs)
    assert close(loss, float(sequence_loss.detach()))
    assert torch.allclose(token_grad, sequence_grad, atol=1e-7)
    assert (token_grad[2] == 0).all()


def test_gspo_clips_whole_sequences() -> None:
    # s = exp(0.01) is outside [1 - 3e-4, 1 + 4e-4]: with A > 0 the sequence is clipped.
    batch = make_batch(
        [[0.01, 0.01], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0], [[1.0, 1.0], [1.0, 1.0]]
    )
    settings = get_algorithm("gspo").defaults
    loss, metrics = gspo_loss(batch, settings, num_tokens=4, num_sequences=2)
    assert close(loss, (-(1 + 4e-4) - 1.0) / 2, tol=1e-6)
    assert close(metrics["clip_frac"], 0.5)
    loss.backward()
    assert batch.logprobs.grad is not None
    assert_values(batch.logprobs.grad, [[0.0, 0.0], [-0.25, -0.25]])


# --- AIPO --------------------------------------------------------------------------------------


def test_aipo_truncates_weights_at_rho() -> None:
    old = [[math.log(0.5), math.log(0.6), math.log(0.9)]]
    behaviour = [[math.log(1.0), math.log(0.2), math.log(0.09)]]  # weights 0.5, 3, 10
    weight = aipo_weight(torch.tensor(old), torch.tensor(behaviour), rho=2.0)
    assert_values(weight, [[0.5, 2.0, 2.0]])

    batch = make_batch(old, old, [-1.5], [[1.0, 1.0, 1.0]], behaviour_logprobs=behaviour)
    loss, metrics = aipo_loss(batch, LossSettings(aipo_rho=2.0), num_tokens=3, num_sequences=1)
    assert close(loss, 1.5 * (0.5 + 2.0 + 2.0) / 3)
    assert close(metrics["truncated_frac"], 2 / 3)
    loss.backward()
    assert batch.logprobs.grad is not None
    assert_values(batch.logprobs.grad, [[0.25, 1.0, 1.0]])  # 1.5 * w / 3


def test_aipo_needs_rho_and_behaviour_logprobs() -> None:
    batch = make_batch([[0.0]], [[0.0]], [1.0], [[1.0]])
    with pytest.raises(ValueError, match="aipo_rho"):
        aipo_loss(batch, LossSettings(), num_tokens=1, num_sequences=1)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        aipo_loss(batch, LossSettings(aipo_rho=2.0), num_tokens=1, num_sequences=1)


# --- DAPO dynamic sampling ---------------------------------------------------------------------


def test_dapo_filter_keeps_groups_with_distinct_rewards() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.2]])
    assert dynamic_sampling_filter(rewards).tolist() == [False, True, False, True]
    assert get_algorithm("dapo").keep_groups(rewards).tolist() == [False, True, False, True]
    assert get_algorithm("grpo").keep_groups(rewards).tolist() == [True] * 4


# --- registry ----------------------------------------------------------------------------------


def test_registry_entries_share_one_signature() -> None:
    assert set(ALGORITHMS) == {"grpo", "dapo", "gspo", "aipo"}
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    generator = torch.Generator().manual_seed(2)
    for name, algorithm in ALGORITHMS.items():
        advantages = algorithm.advantages(rewards, algorithm.defaults)
        a = 0.5 / (math.sqrt(0.5) + EPS)  # mean 0.5, unbiased std sqrt(0.5)
        assert_values(advantages, [[a, -a], [0.0, 0.0]])
        old = -torch.rand(2, 4, generator=generator)
        batch = PolicyBatch(
            logprobs=(old + 0.01).requires_grad_(True),
            old_logprobs=old,
            advantages=advantages[:, 0],
            mask=torch.ones(2, 4),
            behaviour_logprobs=old - 0.1,
        )
        loss, metrics = algorithm.loss(batch, algorithm.defaults, num_tokens=8, num_sequences=2)
        assert loss.dim() == 0 and torch.isfinite(loss), name
        assert "pg_loss" in metrics and all(m.dim() == 0 for m in metrics.values()), name
    assert get_algorithm("dapo").defaults.epsilon_high == 0.28
    with pytest.raises(ValueError, match="'aipo', 'dapo', 'grpo', 'gspo'"):
        get_algorithm("ppo")


# --- long sequences ----------------------------------------------------------------------------


def test_long_sequences_stay_finite_and_match() -> None:
    rng = random.Random(3)
    num_steps = 4096
    old = [[-rng.random() * 5 for _ in range(num_steps)] for _ in range(2)]
    logprobs = [[o + rng.uniform(-0.05, 0.05) for o in row] for row in old]
    mask = [[1.0] * num_steps, [1.0] * 1000 + [0.0] * (num_steps - 1000)]
    advantages = [0.7, -1.3]
    num_tokens = num_steps + 1000
    settings = LossSettings(loss_type="seq-mean-token-mean")

    loss, _ = grpo_loss(
        make_batch(logprobs, old, advantages, mask),
        settings,
        num_tokens=num_tokens,
        num_sequences=2,
    )
    expected = 0.0
    for lp_row, o_row, a, m_row in zip(logprobs, old, advantages, mask, strict=True):
        tokens = [
            max(-a * math.exp(lp - o), -a * min(max(math.exp(lp - o), 0.8), 1.2))
            for lp, o, m in zip(lp_row, o_row, m_row, strict=True)
            if m
        ]
        expected += sum(tokens) / len(tokens)
    assert torch.isfinite(loss) and close(loss, expected / 2, tol=1e-4)

    gspo_settings = dataclasses.replace(settings, epsilon_low=0.5, epsilon_high=0.5)
    batch = make_batch(logprobs, old, advantages, mask)
    loss, _ = gspo_loss(batch, gspo_settings, num_tokens=num_tokens, num_sequences=2)
    expected = 0.0
    for lp_row, o_row, a, m_row in zip(logprobs, old, advantages, mask, strict=True):
        diffs = [lp - o for lp, o, m in zip(lp_row, o_row, m_row, strict=True) if m]
        expected += -a * math.exp(sum(diffs) / len(diffs))
    assert torch.isfinite(loss) and close(loss, expected / 2, tol=1e-4)
    loss.backward()
    assert batch.logprobs.grad is not None and torch.isfinite(batch.logprobs.grad).all()


# --- SFT ---------------------------------------------------------------------------------------


def log_softmax(row: list[float], index: int) -> float:
    return row[index] - math.log(sum(math.exp(x) for x in row))


def test_sft_loss_shifts_and_masks() -> None:
    logits = [[[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]]]
    # input ids [0, 1, 2, 0]; the prompt is position 0-1, the assistant answer positions 2-3
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 2, 0]])
    assert sft_num_tokens(labels) == 2
    loss = sft_loss(torch.tensor(logits), labels, num_tokens=4)
    # logits[t] predicts labels[t + 1]: position 1 predicts 2, position 2 predicts 0
    expected = -(log_softmax(logits[0][1], 2) + log_softmax(logits[0][2], 0)) / 4
    assert close(loss, expected)


def test_sft_loss_rewards_predicting_the_next_token() -> None:
    tokens = torch.tensor([[3, 1, 4, 1, 0, 2]])
    right = torch.full((1, 6, 5), -20.0)
    right[0, torch.arange(5), tokens[0, 1:]] = 20.0  # position t puts its mass on token t + 1
    wrong = torch.full((1, 6, 5), -20.0)
    wrong[0, torch.arange(6), tokens[0]] = 20.0  # position t puts its mass on token t
    assert float(sft_loss(right, tokens, num_tokens=5)) < 1e-6
    assert float(sft_loss(wrong, tokens, num_tokens=5)) > 10.0


def test_sft_loss_of_fully_masked_labels_is_zero() -> None:
    logits = torch.randn(2, 3, 4, requires_grad=True)
    loss = sft_loss(logits, torch.full((2, 3), IGNORE_INDEX), num_tokens=0)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert logits.grad is not None and (logits.grad == 0).all()
    with pytest.raises(ValueError, match="labels"):
        sft_loss(logits, torch.zeros(2, 4, dtype=torch.long), num_tokens=1)


def test_sft_loss_from_logprobs_sums_masked_targets() -> None:
    target_logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -7.0, -3.0]], requires_grad=True)
    loss_mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss = sft_loss_from_logprobs(target_logprobs, loss_mask, num_tokens=6)
    assert close(loss, (1.0 + 2.0 + 0.1) / 6)
    loss.backward()
    assert target_logprobs.grad is not None
    assert_values(target_logprobs.grad, (-loss_mask / 6).tolist())
