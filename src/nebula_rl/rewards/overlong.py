"""Soft overlong punishment from DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", eq. 13).

It takes a response's length in tokens, not its text, so it is added by the caller that knows the
token count rather than registered with the text rewards.
"""

from __future__ import annotations


def overlong_penalty(
    response_length: int,
    *,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> float:
    """Return the length penalty (<= 0) to add to a response's reward.

    0 while ``response_length <= max_response_length - buffer_length``; then falls linearly over
    the last ``buffer_length`` tokens to ``-penalty_factor``, reached at ``max_response_length``
    and kept beyond it. Lengths are in tokens.
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be positive, got {max_response_length}")
    if not 0 <= buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in [0, max_response_length={max_response_length}], "
            f"got {buffer_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    if response_length < 0:
        raise ValueError(f"response_length must be >= 0, got {response_length}")
    expected_length = max_response_length - buffer_length
    if response_length <= expected_length:
        return 0.0
    if response_length >= max_response_length:
        return -penalty_factor
    return (expected_length - response_length) / buffer_length * penalty_factor
