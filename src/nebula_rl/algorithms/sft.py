"""Supervised fine-tuning loss: next-token cross-entropy on assistant tokens only.

The standard language-modelling objective as used for instruction tuning (Ouyang et al. 2022,
"Training language models to follow instructions with human feedback", arXiv:2203.02155):
only assistant tokens are trained on; prompt, system and user tokens are masked out.

Shift convention (the Hugging Face one): `labels` is aligned with `input_ids`, and the logits at
position t predict the token at position t + 1. `sft_loss` therefore drops the last logit and
the first label; position 0 is never a target. Labels of -100 are ignored.
The loss is a sum over target tokens divided by an explicit `num_tokens` (the step's global
count), so gradient accumulation over micro-batches and ranks weights every token equally.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
"""Label of positions that are not trained on (prompt, padding)."""


def sft_num_tokens(labels: Tensor) -> int:
    """Number of target tokens in `labels` [B, T] after the shift (what `sft_loss` sums over)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum().item())


def sft_loss(logits: Tensor, labels: Tensor, *, num_tokens: float) -> Tensor:
    """Cross-entropy of logits[:, t] against labels[:, t + 1], summed / num_tokens.

    Args:
        logits: [B, T, V] (carries grad); computed in their own dtype (upcast first if wanted).
        labels: [B, T] token ids aligned with the inputs, IGNORE_INDEX for non-assistant tokens.
        num_tokens: target tokens in the whole step (sum of `sft_num_tokens` over micro-batches
            and ranks); 0 is read as 1, so an all-masked batch gives 0.

    Returns:
        A scalar tensor.
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    total = F.cross_entropy(
        logits[:, :-1].flatten(0, 1),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / max(num_tokens, 1.0)


def sft_loss_from_logprobs(
    target_logprobs: Tensor, loss_mask: Tensor, *, num_tokens: float
) -> Tensor:
    """-sum(target_logprobs * loss_mask) / num_tokens, for log-probs already gathered and shifted.

    Args:
        target_logprobs: [B, T] log p of each target token (carries grad), already aligned:
            entry t is the log-prob of the token that `loss_mask[:, t]` refers to.
        loss_mask: [B, T] float, 1 on assistant target tokens.
        num_tokens: masked tokens in the whole step; 0 is read as 1.
    """
    return -(target_logprobs * loss_mask).sum() / max(num_tokens, 1.0)
