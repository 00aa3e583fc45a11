"""`single_choice` (cosmos-rl's): the letter (or text) of a multiple-choice answer, compared as
the Cosmos-Reason RL recipe scores it."""

from __future__ import annotations

import re

from nebula_rl.rewards.base import register_reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _answer(text: str) -> str:
    """The text of the first `<answer>...</answer>`, else the whole text, stripped."""
    match = _ANSWER.search(text)
    return (match.group(1) if match else text).strip()


@register_reward("single_choice")
def single_choice_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's answer equals the reference's, ignoring case, else 0.0. Each
    side's answer is the inside of its first `<answer>` tags, or the whole text when it has none
    (a reference is often the bare letter)."""
    return 1.0 if _answer(completion).lower() == _answer(reference).lower() else 0.0
