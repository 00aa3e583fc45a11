"""The policy's optimiser and learning-rate schedule, as cosmos-rl builds them.

- `build_optimizer`: AdamW or Adam over the trainable parameters only, one parameter group per
  `train.optm_lr` table entry (the longest module-path prefix that names a parameter wins;
  `global` takes the rest), with the `train.optm_impl` kernels.
- `lr_lambda`: cosmos-rl's warm-up / stable / decay multiplier
  (`cosmos_rl/policy/trainer/optm/__init__.py:build_lr_schedulers`), stepped once per training
  step by a `LambdaLR`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nebula_rl.config import TrainingConfig

__all__ = ["build_optimizer", "lr_lambda", "param_groups"]


def _prefix_matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def param_groups(model: nn.Module, train: TrainingConfig) -> list[dict[str, Any]]:
    """The trainable parameters split by `train.optm_lr`: the `global` group first (possibly
    empty), then one group per other table entry, each with its `lr`."""
    rates = train.optm_lr if isinstance(train.optm_lr, dict) else {"global": train.optm_lr}
    prefixes = sorted((k for k in rates if k != "global"), key=len, reverse=True)
    groups: dict[str, list[nn.Parameter]] = {key: [] for key in ["global", *prefixes]}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        owner = next((prefix for prefix in prefixes if _prefix_matches(name, prefix)), "global")
        groups[owner].append(param)
    unmatched = [prefix for prefix in prefixes if not groups[prefix]]
    if unmatched:
        raise ValueError(
            f"train.optm_lr: {unmatched} name no trainable parameter (keys are module paths "
            "such as 'model.embed_tokens', matched as prefixes of parameter names)"
        )
    return [{"params": params, "lr": rates[key], "name": key} for key, params in groups.items()]


def _check_fused(model: nn.Module, train: TrainingConfig) -> None:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    for name, param in model.named_parameters():
        if param.requires_grad and (
            param.device.type not in supported or not torch.is_floating_point(param)
        ):
            raise ValueError(
                f'train.optm_impl = "fused": fused {train.optm_name} has no kernel for '
                f"{name} ({param.dtype} on {param.device.type}; fused kernels exist for "
                f'{supported}); use "foreach" or "for-loop"'
            )


def build_optimizer(model: nn.Module, train: TrainingConfig) -> torch.optim.Optimizer:
    """`train.optm_name` over the trainable parameters of `model` (see `param_groups`)."""
    if train.optm_impl == "fused":
        _check_fused(model, train)
    impl = {
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for-loop": {"foreach": False},
    }[train.optm_impl]
    opt_cls = torch.optim.AdamW if train.optm_name == "AdamW" else torch.optim.Adam
    return opt_cls(
        param_groups(model, train),
        lr=train.peak_lr,
        betas=train.optm_betas,
        eps=train.epsilon,
        weight_decay=train.optm_weight_decay,
        **impl,
    )


def lr_lambda(train: TrainingConfig, total_steps: int) -> Callable[[int], float]:
    """LR multiplier for scheduler step s (0 for the first training step), as cosmos-rl's.

    With T = total_steps: W warm-up steps (`optm_warmup_steps`, a float <= 1 being a fraction
    of T; at most T) rise linearly from `optm_warmup_start_factor` to 1; the last D steps
    (`optm_decay_ratio` of T, at most T - W; None: all after warm-up) decay with
    `optm_decay_type` towards `optm_min_lr_factor`; in between the rate is the peak. The stable
    phase has one "virtual" step more (T + 1 - W - D), so the last step's rate stays above the
    floor. `optm_min_lr_factor` applies in the decay phase only.
    """
    warmup = train.optm_warmup_steps
    warmup = int(warmup * total_steps) if isinstance(warmup, float) and warmup <= 1.0 else warmup
    warmup = min(int(warmup), total_steps)
    if train.optm_decay_ratio is not None:
        decay = min(round(total_steps * train.optm_decay_ratio), total_steps - warmup)
    else:
        decay = total_steps - warmup
    stable = total_steps + 1 - warmup - decay
    start, floor, shape = (
        train.optm_warmup_start_factor,
        train.optm_min_lr_factor,
        train.optm_decay_type,
    )

    def factor(step: int) -> float:
        if step < warmup:
            return 1.0 if warmup == 1 else start + (1.0 - start) * step / (warmup - 1)
        if step < warmup + stable:
            return 1.0
        # (min: steps past T, which cosmos-rl never takes, keep the floor)
        progress = min(1.0, (step + 1 - (warmup + stable)) / decay)
        value = {
            "linear": lambda: 1.0 - progress,
            "sqrt": lambda: 1.0 - math.sqrt(progress),
            "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * progress)),
            "none": lambda: 1.0,
            None: lambda: 1.0,
        }[shape]()
        return floor + (1.0 - floor) * value

    return factor
