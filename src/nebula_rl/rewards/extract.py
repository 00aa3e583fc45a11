"""Text helpers shared by the rewards: find the final answer a completion commits to."""

from __future__ import annotations

import re
from fractions import Fraction

# A decimal number: optional sign (not a minus that follows a digit, as in "10-2"), thousands
# groups ("1,000"), an optional fraction part. A trailing "." ("18.") is left out.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_HASHES = "####"


def last_boxed(text: str) -> str | None:
    r"""Return the content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``.

    Braces are matched, so ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``; ``\boxed 5`` gives ``5``.
    Returns ``None`` when there is no box or the last one is never closed.
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        # "\boxed 5": the argument is one token; a bare "\boxed" followed by nothing is no answer.
        if stripped == rest:
            return None
        token = re.match(r"[^\s$]+", stripped)
        return token.group(0) if token else None
    depth = 0
    for i, char in enumerate(stripped):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return stripped[1:i]
    return None


def hashes_answer(text: str) -> str | None:
    """Return the text on the line after the last ``####`` in ``text`` (GSM8K style), stripped."""
    index = text.rfind(_HASHES)
    if index < 0:
        return None
    tail = text[index + len(_HASHES) :].strip()
    return tail.splitlines()[0].strip() if tail else ""


def numbers(text: str) -> list[str]:
    """Return every decimal number in ``text`` in order, as written ("1,000", "-3", "2.5")."""
    return _NUMBER.findall(text)


def to_fraction(number: str) -> Fraction | None:
    """Parse a number as written by a person ("$1,000", "18.", "2.50") exactly; ``None`` if not one."""
    cleaned = number.strip().replace(",", "").replace("\\$", "").replace("$", "").rstrip(".")
    # Fraction("1/2") parses, but a GSM8K-style number is never a ratio.
    if not cleaned or "/" in cleaned:
        return None
    try:
        return Fraction(cleaned)
    except ValueError:
        return None
