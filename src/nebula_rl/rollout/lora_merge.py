"""A LoRA policy's adapter, merged into a rollout engine's weights at the token boundary.

A LoRA policy (`policy.lora`) pushes its adapter rather than merged weights
(`nebula_rl.models.lora.adapter_parameters`): per adapted linear module `<m>`,
`<m>.lora_A.weight` [r, in] and `<m>.lora_B.weight` [out, r] (the scale folded into B), the
frozen base weight `<m>.base_layer.weight`, and every other parameter under its plain name.
`LoraMerge` is the rollout rank's side of that:

- the weight receiver writes the engine's own parameters, less the adapted weights, and three
  buffers per adapted module, this rank's parts of the base (engine dtype), A and B (float32
  when the engine's dtype is narrower, so that B @ A is not rounded before it is added);
- after each receive, inside the same `engine.update_weights_with` write (under the step lock,
  between two token steps), `merge` writes every adapted weight in place: W = W0 + B @ A,
  computed in float32 where the engine's dtype is narrower and rounded once. In place, because
  the engine's fused forward holds views of its parameters. (The base is held in the engine's
  dtype, so a bf16 engine's adapted weight is within a bf16 unit of the policy's float32 merge
  rounded once, not always equal to it.)

Under tensor parallelism each rank merges its own part from its own parts of A and B, derived
from the weight's box (`TorchEngine.tp_boxes`): a weight split by rows (column parallel: q, k,
v, gate, up) needs B's matching rows and all of A; one split by columns (row parallel: o,
down) needs A's matching columns and all of B. The planner then sends each rank those slices.

The adapted modules are found as the policy finds them (`nebula_rl.models.lora.
adapted_modules`: peft's own injection on a weightless copy of the architecture), so
target_modules, "all-linear", and the rank and alpha patterns mean the same on both sides.

Cost: the rollout holds one extra copy of the adapted weights (the base; with zero-copy
receivers it sits in the shared-memory sets, which hold the base, A and B instead of the
adapted weights, while the engine keeps the merged weights in tensors of its own), and each
push after a group's first moves only A, B and the `modules_to_save` copies: r (in + out)
numbers per adapted layer instead of in x out (the demo's model, rank 8 on every linear
layer, float32: 0.59 MB instead of 11.6 MB per push; `bench/lora_push.py`). The merge is one
matmul of inner dimension r per adapted layer, on the rollout's device, in the engine's pause
(4.3 ms for the demo's model on one CPU thread).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nebula_rl.config import LoraConfig
from nebula_rl.models.lora import adapted_modules
from nebula_rl.weights.reshard import Box

__all__ = ["LoraMerge"]


@dataclass(frozen=True, slots=True)
class _Adapted:
    """One adapted linear layer on this rank; the tensors are the receiver's objects, read
    after every receive (a zero-copy receiver re-points them at shared memory)."""

    weight: Tensor
    """The engine's parameter (this rank's box of [out, in]), written in place."""
    base: Tensor
    """The base weight as the policy pushed it (the same box), in the engine's dtype."""
    a: Tensor
    """This rank's columns of A: [r, the box's in-features]."""
    b: Tensor
    """This rank's rows of B (scale folded in): [the box's out-features, r]."""


class LoraMerge:
    """The adapter receiver and merge of one rollout rank (see the module docstring).

    `model` is the engine's model (this rank's shards) and `boxes` its `tp_boxes()`; `lora`
    the job's `policy.lora`. `tensors` and `boxes` are what the weight receiver writes."""

    def __init__(
        self,
        model: nn.Module,
        boxes: Mapping[str, tuple[tuple[int, ...], Box]],
        lora: LoraConfig,
    ) -> None:
        params = dict(model.named_parameters())
        self.tensors: dict[str, Tensor] = {}
        """What the receiver writes: the engine's parameters less the adapted weights, and
        each adapted module's base, A and B buffers."""
        self.boxes: dict[str, tuple[tuple[int, ...], Box]] = {}
        """Per name of `tensors`: the full tensor's shape and the box this rank holds."""
        self._adapted: list[_Adapted] = []
        ranks = adapted_modules(model, lora)
        for name, param in params.items():
            module = name.removesuffix(".weight")
            if module not in ranks:
                self.tensors[name], self.boxes[name] = param, boxes[name]
                continue
            (out_features, in_features), ((r0, r1), (c0, c1)) = boxes[name]
            r = ranks[module]
            wide = torch.float32 if param.dtype.itemsize < 4 else param.dtype
            base = param.detach().clone()  # (overwritten by the first push)
            a = torch.zeros(r, c1 - c0, dtype=wide, device=param.device)
            b = torch.zeros(r1 - r0, r, dtype=wide, device=param.device)
            parts = {
                f"{module}.base_layer.weight": (base, boxes[name]),
                f"{module}.lora_A.weight": (a, ((r, in_features), ((0, r), (c0, c1)))),
                f"{module}.lora_B.weight": (b, ((out_features, r), ((r0, r1), (0, r)))),
            }
            for part, (tensor, box) in parts.items():
                self.tensors[part], self.boxes[part] = tensor, box
            self._adapted.append(_Adapted(param, base, a, b))
        missing = sorted(set(ranks) - {n.removesuffix(".weight") for n in params})
        assert not missing, f"adapted modules without a weight in the engine: {missing[:3]}"

    @property
    def num_adapted(self) -> int:
        """Adapted linear layers on this rank."""
        return len(self._adapted)

    def merge(self) -> None:
        """Write W = W0 + B @ A into every adapted weight of the engine, in place, from the
        last push's base, A and B (call it where the engine takes weights: under its step
        lock, after the receive)."""
        with torch.no_grad():
            for layer in self._adapted:
                merged = layer.b @ layer.a
                merged += layer.base  # (in float32 where the engine's dtype is narrower)
                layer.weight.copy_(merged)  # (rounded once)

    def after(self, version: int | None) -> int | None:
        """`version`, once the push just received (`version` None: it failed part-way, and
        the engine generates nothing until the next) is merged into the weights."""
        if version is not None:
            self.merge()
        return version
