r"""Format rewards: does the completion have the shape the task asks for?

- `format` (cosmos-rl's): the whole completion is `<think>...</think>`, exactly two newlines,
  then `<answer>...</answer>` (a final newline tolerated), with no `<think>` or `</think>` tag
  inside the thinking. Stricter than the Cosmos-Reason RL prompt, which asks for the two parts
  "separated by a space": a completion that follows the prompt word for word scores 0.
- `answer_format`: the completion states a final answer a checker can read, as ``\boxed{...}``
  or ``#### N`` (what the math and GSM8K tasks ask for).
"""

from __future__ import annotations

import re

from nebula_rl.rewards.base import register_reward
from nebula_rl.rewards.extract import hashes_answer, last_boxed, numbers

_THINK_ANSWER = re.compile(r"<think>(?:(?!</?think>).)*</think>\n\n<answer>.*?</answer>\n?", re.S)


@register_reward("format")
def format_reward(completion: str, reference: str) -> float:
    """1.0 if the completion is exactly `<think>...</think>\\n\\n<answer>...</answer>`, else 0.0
    (the reference is ignored)."""
    del reference
    return 1.0 if _THINK_ANSWER.fullmatch(completion) else 0.0


@register_reward("answer_format")
def answer_format_reward(completion: str, reference: str) -> float:
    r"""1.0 if the completion states a final answer as ``\boxed{...}`` or ``#### N``, else 0.0.

    The box must be closed and non-empty; ``####`` must be followed by a number on its line. The
    reference is ignored: this rewards the form of the answer, not its value, and is meant to be
    combined with a small weight alongside a correctness reward.
    """
    del reference
    boxed = last_boxed(completion)
    if boxed is not None and boxed.strip():
        return 1.0
    tail = hashes_answer(completion)
    return 1.0 if tail is not None and numbers(tail) else 0.0
