"""Exact-match reward for the built-in arithmetic task, whose answers are integers."""

from __future__ import annotations

import re

from nebula_rl.rewards.base import register_reward

_INTEGER = re.compile(r"-?\d+")


@register_reward("arithmetic")
def arithmetic_reward(completion: str, reference: str) -> float:
    """1.0 if the completion, stripped of surrounding whitespace, is the reference integer.

    The match is on the canonical decimal form (``str(int(reference))``): ``"12"`` and ``" 12\\n"``
    score 1.0 but ``"012"``, ``"+12"`` and ``"12.0"`` score 0.0, because the task teaches the
    model to print exactly the number and a looser check would reward a sloppier format. Raises
    ``ValueError`` if the reference is not an integer (a data error, not a wrong completion).
    """
    gold = reference.strip()
    if not _INTEGER.fullmatch(gold):
        raise ValueError(f"arithmetic reference must be an integer, got {reference!r}")
    return 1.0 if completion.strip() == str(int(gold)) else 0.0
