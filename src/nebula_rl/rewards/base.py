"""The reward registry and weighted combinations of rewards.

A reward is a pure function ``fn(completion, reference) -> float`` of text: ``completion`` is the
generated response and ``reference`` is the dataset's answer column as a string. A function that
also takes a ``custom`` keyword (or ``**kwargs``) is given the config's free-form ``[custom]``
table as ``custom=``. Rewards are run in a process pool, so they must be picklable, i.e.
top-level functions of an importable module; ``register_reward`` refuses anything else.

With ``grouped`` (``train.train_policy.group_reward_calculation``, cosmos-rl's key), a user's
reward function is called once per group instead: ``fn(completions, reference) -> list[float]``,
``completions`` the group's responses, one value back for each (e.g. a reward that ranks a group's
answers against each other). nebula-rl's own rewards score one completion at a time and are
mapped over the group.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

RewardFn = Callable[[str, str], float]
"""``fn(completion, reference) -> float``; positional because every caller passes both."""

REWARDS: dict[str, RewardFn] = {}
"""Every reward known by name; filled by ``register_reward``."""

_F = TypeVar("_F", bound=RewardFn)


def register_reward(name: str) -> Callable[[_F], _F]:
    """Return a decorator that registers a reward function under ``name`` in ``REWARDS``.

    The function is returned unchanged so it stays picklable by reference. It must be a top-level
    function of an importable module (no lambda or closure), because rewards are sent
    to worker processes. Registering a different function under a taken name is an error;
    re-registering the same function (a module imported twice) is not.
    """
    if not name or ":" in name:
        raise ValueError(f"reward name must be non-empty and contain no ':', got {name!r}")

    def decorator(fn: _F) -> _F:
        if not callable(fn):
            raise ValueError(f"reward {name!r} must be callable, got {type(fn).__name__}")
        # Lambdas and closures ("<lambda>", "f.<locals>.g") cannot be pickled by reference.
        if "<" in getattr(fn, "__qualname__", ""):
            raise ValueError(
                f"reward {name!r} must be a top-level function of an importable module so it can "
                f"be pickled into worker processes, got {fn!r}"
            )
        existing = REWARDS.get(name)
        if existing is not None and _qualified_name(existing) != _qualified_name(fn):
            raise ValueError(
                f"reward {name!r} is already registered to {_qualified_name(existing)}; "
                f"pick another name for {_qualified_name(fn)}"
            )
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """Look up a reward by registered name, or load one from a ``"module.path:function"`` string.

    Raises ``ValueError`` naming the known rewards when ``name`` is neither.
    """
    if ":" in name:
        return _import_reward(name)
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}, "
            "or give a 'module.path:function' import path"
        ) from None


def takes_custom(fn: Callable[..., Any]) -> bool:
    """Whether `fn` accepts a `custom` keyword argument (by name, or through `**kwargs`)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "custom" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


@dataclass(frozen=True, slots=True)
class CombinedReward:
    """A weighted sum of rewards: ``sum(weight * fn(completion, reference))``.

    Functions that take a ``custom`` keyword are called with ``custom=self.custom`` (the config's
    ``[custom]`` table). Picklable as long as every term's function is (registered ones are), so
    it can be sent to a process pool as is.
    """

    terms: tuple[tuple[str, RewardFn, float], ...]
    """``(name, fn, weight)`` for each summed reward, in the order given."""
    custom: dict[str, Any] = field(default_factory=dict)
    """Passed as ``custom=`` to the functions that take it."""
    grouped: bool = False
    """Call each user function once per group (see the module docstring)."""

    def __call__(self, completion: str, reference: str) -> float:
        """Return the weighted sum of every term's reward for one completion."""
        values = self.values(completion, reference)
        return sum(weight * values[name] for name, _, weight in self.terms)

    def values(self, completion: str, reference: str) -> dict[str, float]:
        """Each term's own (unweighted) reward for one completion, by name."""
        return {name: float(self._call(fn, completion, reference)) for name, fn, _ in self.terms}

    def group_values(self, completions: Sequence[str], reference: str) -> list[dict[str, float]]:
        """Each term's own (unweighted) reward for each of a group's completions: per
        completion, or with `grouped` one call per user function for the whole group."""
        if not self.grouped:
            return [self.values(c, reference) for c in completions]
        out: list[dict[str, float]] = [{} for _ in completions]
        for name, fn, _ in self.terms:
            if _per_completion(fn):
                values = [self._call(fn, c, reference) for c in completions]
            else:
                result = self._call(fn, list(completions), reference)
                values = _group_result(name, result, len(completions))
            for row, value in zip(out, values, strict=True):
                row[name] = float(value)
        return out

    def _call(self, fn: Callable[..., Any], completion: Any, reference: str) -> Any:
        if takes_custom(fn):
            return fn(completion, reference, custom=self.custom)
        return fn(completion, reference)

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the summed rewards, e.g. for logging each one separately."""
        return tuple(name for name, _, _ in self.terms)


def _per_completion(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is one of nebula-rl's own rewards, which score one completion at a time."""
    return getattr(fn, "__module__", "").startswith("nebula_rl.rewards.")


def _group_result(name: str, result: Any, count: int) -> list[float]:
    """A group reward function's values, checked: a list of numbers, one per completion."""
    if not isinstance(result, list | tuple) or len(result) != count:
        raise ValueError(
            f"reward {name!r} returned {type(result).__name__} for a group of {count} "
            "completions: with train.train_policy.group_reward_calculation a reward function "
            "takes the group's completions (a list) and returns a list of one number each"
        )
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in result):
        raise ValueError(f"reward {name!r} returned a list that is not all numbers: {result!r}")
    return list(result)


def combine_rewards(
    spec: str | Sequence[str] | Mapping[str, float],
    *,
    custom: Mapping[str, Any] | None = None,
    grouped: bool = False,
) -> CombinedReward:
    """Build the reward a config's ``reward_function`` field describes.

    ``spec`` is one name (``"gsm8k"``), a list of names summed with weight 1.0
    (``["gsm8k", "answer_format"]``), or a mapping of name to weight
    (``{"gsm8k": 1.0, "answer_format": 0.1}``).
    Names are registered names or ``"module.path:function"`` import paths. ``custom`` (the
    config's ``[custom]`` table) goes to the functions that take a ``custom`` keyword;
    ``grouped`` calls user functions once per group (see the module docstring).
    """
    if isinstance(spec, str):
        weights: dict[str, float] = {spec: 1.0}
    elif isinstance(spec, Mapping):
        weights = dict(spec)
    elif isinstance(spec, Sequence):
        if len(set(spec)) != len(spec):
            raise ValueError(f"reward_function lists a reward twice: {list(spec)}")
        weights = dict.fromkeys(spec, 1.0)
    else:
        raise TypeError(
            "reward_function must be a name, a list of names or a {name: weight} mapping, "
            f"got {type(spec).__name__}"
        )
    if not weights:
        raise ValueError("reward_function must name at least one reward")
    terms = []
    for name, weight in weights.items():
        if not isinstance(name, str):
            raise TypeError(f"reward names must be strings, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise TypeError(f"weight of reward {name!r} must be a number, got {weight!r}")
        if not math.isfinite(weight):
            raise ValueError(f"weight of reward {name!r} must be finite, got {weight}")
        terms.append((name, get_reward(name), float(weight)))
    return CombinedReward(terms=tuple(terms), custom=dict(custom or {}), grouped=grouped)


def _qualified_name(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _import_reward(path: str) -> RewardFn:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"reward import path must look like 'module.path:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of reward {path!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (reward {path!r})")
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable, got {type(fn).__name__}")
    return fn
