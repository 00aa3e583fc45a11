"""Training batches: right-padded (or packed) token rows with their loss masks, and how a step's
rows are cut into forward passes.

Shift convention: a row's per-target tensors have one entry less than its tokens; entry t
describes the prediction of token t + 1 from tokens 0..t.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nebula_rl.algorithms import shared_prefix_lengths
from nebula_rl.data.packing import first_fit
from nebula_rl.data.vision import VisionInputs, VisionProcessor
from nebula_rl.protocol import RolloutGroup

__all__ = [
    "TokenBatch",
    "collate_groups",
    "pack_examples",
    "pad_batch",
    "rollout_media",
    "token_budget_micro_batches",
]


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Right-padded sequences with per-target-position tensors (position t predicts t + 1)."""

    input_ids: Tensor
    """[N, L] prompt + response tokens."""
    attention_mask: Tensor
    """[N, L] 1 on real tokens."""
    target_mask: Tensor
    """[N, L-1] float, 1 where the target token is a trained token (response / assistant)."""
    behaviour_logprobs: Tensor
    """[N, L-1] rollout log-probs aligned with `target_mask` (0 elsewhere, and everywhere when
    the rollouts sent none)."""
    advantages: Tensor
    """[N] per-sequence advantage (0 for SFT)."""
    segment_ids: Tensor | None = None
    """[N, L] packed rows only: 1, 2, ... for the examples of a row, 0 on padding."""
    media: tuple[VisionInputs | None, ...] | None = None
    """Vision-language rows: each row's images and videos (None: a row without), whose pixels
    go to the forward with the tokens."""

    @property
    def lengths(self) -> list[int]:
        """Tokens of each row (without padding)."""
        return [int(n) for n in self.attention_mask.sum(1).tolist()]

    def select(self, rows: Sequence[int]) -> TokenBatch:
        """These rows, in this order, trimmed of columns that are padding in all of them."""
        index = torch.tensor(list(rows), dtype=torch.long)
        length = int(self.attention_mask[index].sum(1).max()) if len(index) else 1
        return TokenBatch(
            input_ids=self.input_ids[index, :length],
            attention_mask=self.attention_mask[index, :length],
            target_mask=self.target_mask[index, : length - 1],
            behaviour_logprobs=self.behaviour_logprobs[index, : length - 1],
            advantages=self.advantages[index],
            segment_ids=None if self.segment_ids is None else self.segment_ids[index, :length],
            media=None if self.media is None else tuple(self.media[i] for i in rows),
        )

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Rows [start, stop), trimmed of columns that are padding in all of them."""
        return self.select(range(start, stop))


def pad_batch(
    sequences: Sequence[tuple[list[int], list[int], list[float]]], advantages: Tensor, pad_id: int
) -> TokenBatch:
    """(token ids, trained-token mask, behaviour logprobs per token) -> right-padded TokenBatch."""
    n, length = len(sequences), max(len(ids) for ids, _, _ in sequences)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.float32)
    behaviour = torch.zeros((n, length), dtype=torch.float32)
    for i, (ids, m, lp) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        behaviour[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    # Shift to target space: entry t describes input_ids[:, t + 1].
    return TokenBatch(input_ids, attention, mask[:, 1:], behaviour[:, 1:], advantages)


def pack_examples(
    examples: Sequence[tuple[list[int], list[int]]], *, max_length: int, pad_id: int
) -> TokenBatch:
    """(token ids, assistant mask) conversations packed first-fit into rows of at most
    `max_length` tokens, with their segment ids.

    An example's first token is no target: in its own row nothing before it would predict it, and
    in a packed row it would be predicted from the previous example.
    """
    rows = first_fit([len(ids) for ids, _ in examples], max_length=max_length)
    sequences, segments = [], []
    for row in rows:
        ids: list[int] = []
        mask: list[int] = []
        segment: list[int] = []
        for number, i in enumerate(row, start=1):
            example_ids, example_mask = examples[i]
            ids += example_ids
            mask += [0, *example_mask[1:]]
            segment += [number] * len(example_ids)
        sequences.append((ids, mask, [0.0] * len(ids)))
        segments.append(segment)
    batch = pad_batch(sequences, torch.zeros(len(rows)), pad_id)
    segment_ids = torch.zeros_like(batch.input_ids)
    for r, segment in enumerate(segments):
        segment_ids[r, : len(segment)] = torch.tensor(segment)
    return TokenBatch(
        batch.input_ids,
        batch.attention_mask,
        batch.target_mask,
        batch.behaviour_logprobs,
        batch.advantages,
        segment_ids,
    )


def collate_groups(
    groups: Sequence[RolloutGroup],
    advantages: Tensor,
    *,
    pad_id: int,
    with_logprobs: bool = True,
    min_filter_prefix_tokens: int | None = None,
    eos_token_ids: Sequence[int] = (),
) -> TokenBatch:
    """Flatten groups to one row per completion: prompt + response, response tokens trained.

    `with_logprobs`: the completions carry one rollout log-prob per token (else their
    log-probs are not read, and `behaviour_logprobs` is 0). `min_filter_prefix_tokens`: within
    each group, the tokens of long shared prefixes with different rewards get no loss
    (`nebula_rl.algorithms.shared_prefix_lengths`, given the model's end-of-sequence ids).
    """
    sequences = []
    for group in groups:
        p = group.prompt_token_ids
        skips = (
            shared_prefix_lengths(
                [c.token_ids for c in group.completions],
                group.rewards,
                min_tokens=min_filter_prefix_tokens,
                eos_token_ids=eos_token_ids,
            )
            if min_filter_prefix_tokens is not None
            else [0] * len(group.completions)
        )
        for c, skip in zip(group.completions, skips, strict=True):
            if with_logprobs and len(c.logprobs) != len(c.token_ids):
                raise ValueError(
                    f"prompt {group.prompt.prompt_id}: a completion of {len(c.token_ids)} tokens "
                    f"carries {len(c.logprobs)} log-probs, but "
                    "train.train_policy.collect_rollout_logprobs is true"
                )
            n = len(c.token_ids)
            trained = [0] * skip + (c.loss_mask[skip:] if c.loss_mask else [1] * (n - skip))
            sequences.append(
                (
                    p + c.token_ids,
                    [0] * len(p) + trained,
                    [0.0] * len(p) + (c.logprobs if with_logprobs else [0.0] * n),
                )
            )
    return pad_batch(sequences, advantages.flatten().float(), pad_id)


def rollout_media(
    vision: VisionProcessor,
    groups: Sequence[RolloutGroup],
    prompts: Sequence[str | list[dict[str, Any]]],
    *,
    system_prompt: str = "",
) -> list[VisionInputs | None]:
    """Each group's images and videos, built again from its prompt (`prompts[i]`, the text or
    messages of `groups[i]`; media travel by reference) as the rollout built them, for the
    policy's forward; None for a prompt without media.

    The policy's tokens of each prompt must be the rollout's, token for token: log-probs of
    completions conditioned on other tokens (a different image size, another template) would be
    wrong without any error. A difference is refused, naming the prompt and the first token."""
    out: list[VisionInputs | None] = []
    for group, prompt in zip(groups, prompts, strict=True):
        inputs = vision.prompt(prompt, system_prompt=system_prompt)
        ours, theirs = inputs.input_ids, list(group.prompt_token_ids)
        if ours != theirs:
            at = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                min(len(ours), len(theirs)),
            )
            raise ValueError(
                f"prompt {group.prompt.prompt_id}: the policy builds {len(ours)} prompt tokens, "
                f"the rollout sent {len(theirs)}, first different at token {at}: both must "
                "render the prompt with the same chat template, processor and vision settings"
            )
        out.append(inputs if inputs.has_media else None)
    return out


def token_budget_micro_batches(lengths: Sequence[int], *, max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` split into as few micro-batches of at most `max_tokens` tokens
    (raised to the longest sequence) as a balanced partition finds.

    Starting from ceil(total / max_tokens) micro-batches, sequences go longest first to the
    least-filled one (LPT); while one overflows, there is one more micro-batch. Indices keep
    their order within a micro-batch.
    """
    if not lengths:
        return []
    budget = max(max_tokens, *lengths)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    count = math.ceil(sum(lengths) / budget)
    while True:
        loads = [0] * count
        bins: list[list[int]] = [[] for _ in range(count)]
        for i in order:
            target = loads.index(min(loads))
            loads[target] += lengths[i]
            bins[target].append(i)
        if max(loads) <= budget:
            return sorted(sorted(b) for b in bins if b)
        count += 1
