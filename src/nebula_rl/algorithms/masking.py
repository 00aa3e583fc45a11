"""Which tokens carry loss: off-policy sequence masking and shared-prefix filtering.

- Off-policy sequence masking (DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier of Open
  Large Language Models", Sec. 3.1): a negative-advantage sequence that the current policy
  already finds much less likely than the policy that produced it (mean over its tokens of
  log(pi_old / pi_theta) > delta) is mostly noise from staleness and gets no policy loss.
- Shared-prefix filtering (cosmos-rl's `min_filter_prefix_tokens`,
  `cosmos_rl/utils/util.py:find_maximal_prefix_groups`): completions of one prompt that begin
  with the same long token prefix but earn different rewards push that prefix up and down at
  once; its tokens carry no signal about which continuation was better, so they are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def off_policy_sequence_mask(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, delta: float
) -> Tensor:
    """float [B]: 0 for sequences with A < 0 and mean_t(old - logprobs) > delta, 1 otherwise.

    Args:
        logprobs: [B, T] log pi_theta (only its value is read).
        old_logprobs: [B, T] log-probs of the policy the mask compares with (cosmos-rl: the
            rollout's when the batch has them, else the proximal policy's).
        advantages: [B] one advantage per sequence.
        mask: [B, T] float, 1 on completion tokens; a sequence without any has mean 0.
        delta: the threshold (>= 0 in the paper).
    """
    log_ratio = (old_logprobs.detach() - logprobs.detach()) * mask
    mean = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    dropped = (advantages < 0) & (mean > delta)
    return (~dropped).to(logprobs.dtype)


def _maximal_prefix_groups(
    sequences: Sequence[Sequence[int]], min_tokens: int
) -> list[tuple[int, list[int]]]:
    """(prefix length, members) of every maximal shared prefix of at least `min_tokens` tokens.

    In the trie of `sequences` a node holds the sequences that pass through it or end at it; a
    group is a node at depth >= min_tokens holding >= 2 sequences none of whose children holds
    >= 2 (the deepest prefix they share). A sequence is in at most one group.
    """
    root: dict[int, dict] = {}
    members: dict[int, list[int]] = {}  # id(node) -> sequences through it
    for index, tokens in enumerate(sequences):
        node = root
        for token in tokens:
            node = node.setdefault(token, {})
            members.setdefault(id(node), []).append(index)
    groups = []
    stack: list[tuple[dict, int]] = [(child, 1) for child in root.values()]
    while stack:
        node, depth = stack.pop()
        shared = members[id(node)]
        if len(shared) < 2:
            continue  # no descendant is shared either
        deeper = [child for child in node.values() if len(members[id(child)]) >= 2]
        if depth >= min_tokens and not deeper:
            groups.append((depth, shared))
        stack += [(child, depth + 1) for child in deeper]
    return groups


def shared_prefix_lengths(
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    min_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """How many leading tokens of each completion of one group to leave out of the loss.

    For every maximal prefix of >= `min_tokens` tokens shared by >= 2 completions (see
    `_maximal_prefix_groups`) whose rewards are not all equal, each of those completions skips
    the prefix's tokens, except one that is nothing but the prefix (up to a final end-of-sequence
    token, as cosmos-rl compares the decoded texts): masking it would leave it no tokens at all.

    Args:
        completions: the group's completion token ids.
        rewards: their rewards.
        min_tokens: shortest prefix that counts (cosmos-rl's `min_filter_prefix_tokens`, >= 1).
        eos_token_ids: end-of-sequence ids, stripped from the end before that comparison.
    """
    assert len(completions) == len(rewards), (len(completions), len(rewards))
    assert min_tokens >= 1, min_tokens

    def text_of(tokens: Sequence[int]) -> list[int]:
        return list(tokens[:-1] if tokens and tokens[-1] in eos_token_ids else tokens)

    skip = [0] * len(completions)
    for length, members in _maximal_prefix_groups(completions, min_tokens):
        if len({rewards[i] for i in members}) == 1:
            continue
        prefix = text_of(completions[members[0]][:length])
        for i in members:
            if text_of(completions[i]) != prefix:
                skip[i] = length
    return skip
