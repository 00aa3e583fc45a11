r"""Math rewards checked by math-verify: ``boxed_math`` and ``direct_math``.

Both parse the reference and the completion's final answer to SymPy and ask math-verify whether
they are equal, so ``\boxed{1/2}``, ``\boxed{0.5}`` and ``\boxed{\frac{1}{2}}`` all match ``1/2``.

math-verify bounds parsing and comparison with ``signal.alarm``, which only works in a process's
main thread. In a worker thread we pass ``None`` (no timeout) instead of letting it raise, so a
pathological answer such as ``9^{9^{9^9}}`` can hang that thread: run rewards in a process pool
(each worker runs tasks on its main thread) when completions are untrusted.
"""

from __future__ import annotations

import re
import threading

from nebula_rl.rewards.base import register_reward
from nebula_rl.rewards.extract import last_boxed

PARSE_TIMEOUT_S = 3
"""Whole seconds math-verify may spend parsing one answer (``signal.alarm`` takes an int)."""

VERIFY_TIMEOUT_S = 3
"""Whole seconds math-verify may spend on one gold/prediction comparison."""

# An unescaped "$", or "\(" / "\[": the reference already marks where its math is.
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")


@register_reward("boxed_math")
def boxed_math_reward(completion: str, reference: str) -> float:
    r"""1.0 if the last ``\boxed{...}`` in the completion equals the reference, else 0.0.

    The reference may be a bare answer (``\frac{1}{2}``, ``(1, 2)``), math between ``$``, or a
    full solution ending in ``\boxed{...}``. A completion with no closed box gets 0.0.
    """
    answer = last_boxed(completion)
    if answer is None or not answer.strip():
        return 0.0
    return _verify(reference, _boxed(answer), latex_only=True)


@register_reward("direct_math")
def direct_math_reward(completion: str, reference: str) -> float:
    r"""1.0 if the completion's final answer, boxed or not, equals the reference, else 0.0.

    The final answer is what math-verify extracts from free text: an answer after "final answer
    is" / "answer:" if there is one, else the last LaTeX or plain expression or number.
    """
    return _verify(reference, completion, latex_only=False)


def _boxed(answer: str) -> str:
    return "\\boxed{" + answer + "}"


def _gold_text(reference: str) -> str:
    # Bare answers must be delimited for math-verify to read them whole: "(1, 2)" alone parses
    # as 2 and "x^2+1" not at all, whereas "\boxed{(1, 2)}" is an interval.
    boxed = last_boxed(reference)
    if boxed is not None:
        return _boxed(boxed)
    if _MATH_DELIMITER.search(reference):
        return reference
    return _boxed(reference.strip())


def _verify(reference: str, prediction: str, *, latex_only: bool) -> float:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    in_main_thread = threading.current_thread() is threading.main_thread()
    parse_timeout = PARSE_TIMEOUT_S if in_main_thread else None
    verify_timeout = VERIFY_TIMEOUT_S if in_main_thread else None
    latex = LatexExtractionConfig()
    gold_config = [latex]
    prediction_config = [latex] if latex_only else [latex, ExprExtractionConfig()]
    try:
        gold = parse(_gold_text(reference), gold_config, parsing_timeout=parse_timeout)
        if not gold:
            return 0.0
        predicted = parse(prediction, prediction_config, parsing_timeout=parse_timeout)
        if not predicted:
            return 0.0
        equal = verify(gold, predicted, timeout_seconds=verify_timeout)
    # math-verify already turns its own errors into empty results; this catches what escapes it,
    # e.g. an alarm firing between its try blocks. TimeoutException derives from BaseException.
    except (Exception, TimeoutException):
        return 0.0
    return 1.0 if equal else 0.0
