r"""GSM8K reward: the completion's final number equals the number after the reference's ``####``.

GSM8K answers are whole numbers, so this is plain exact arithmetic on decimals (no math-verify):
``"#### 1,000"``, ``\boxed{\$1000}``, ``"1000."`` and ``"1000.0"`` all read as 1000.
"""

from __future__ import annotations

from fractions import Fraction

from nebula_rl.rewards.base import register_reward
from nebula_rl.rewards.extract import hashes_answer, last_boxed, numbers, to_fraction


@register_reward("gsm8k")
def gsm8k_reward(completion: str, reference: str) -> float:
    r"""1.0 if the completion's final number equals the reference's gold number, else 0.0.

    The gold number follows the reference's last ``####`` (GSM8K's ``answer`` field); a reference
    without ``####`` is itself the number. The completion's answer is, in order of preference: the
    first number after its last ``####``, the last number inside its last ``\boxed{...}``, or the
    last number anywhere. Raises ``ValueError`` if the reference holds no number, since that is a
    data error rather than a wrong completion.
    """
    gold = gold_number(reference)
    answer = completion_number(completion)
    return 1.0 if answer is not None and answer == gold else 0.0


def gold_number(reference: str) -> Fraction:
    """Return the number a GSM8K ``answer`` field ends with (``"...\\n#### 1,234"`` -> 1234)."""
    tail = hashes_answer(reference)
    gold = to_fraction(reference if tail is None else tail)
    if gold is None:
        raise ValueError(
            f"gsm8k reference must end with '#### <number>' or be a number, got {reference[-80:]!r}"
        )
    return gold


def completion_number(completion: str) -> Fraction | None:
    r"""Return the final number a completion commits to (``####``, then ``\boxed``, then last)."""
    tail = hashes_answer(completion)
    if tail is not None:
        found = numbers(tail)
        return to_fraction(found[0]) if found else None
    boxed = last_boxed(completion)
    if boxed is not None:
        found = numbers(boxed)
        return to_fraction(found[-1]) if found else None
    found = numbers(completion)
    return to_fraction(found[-1]) if found else None
