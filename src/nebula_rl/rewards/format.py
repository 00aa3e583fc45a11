r"""Format reward: did the completion end in a final answer a checker can read?"""

from __future__ import annotations

from nebula_rl.rewards.base import register_reward
from nebula_rl.rewards.extract import hashes_answer, last_boxed, numbers


@register_reward("format")
def format_reward(completion: str, reference: str) -> float:
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
