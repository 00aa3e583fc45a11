"""The weights the compact forward multiplies by: linear layers (fused, optionally FP8 with
row-wise scales) and RMS norms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [M, K] as float8 e4m3 rows and their fp32 scales [M, 1] (x ~ rows * scales): each
    row's largest magnitude maps to e4m3's largest finite value (448)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / _FP8_MAX
    return (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8), scale


class _Fp8Weight(NamedTuple):
    """A linear layer's weight in float8 e4m3 with one fp32 scale per output feature."""

    weight: torch.Tensor
    """[out, in] float8 e4m3, row-major (so `.t()` is the column-major operand _scaled_mm takes)."""
    scale: torch.Tensor
    """[1, out] fp32."""

    @classmethod
    def of(cls, weight: torch.Tensor) -> _Fp8Weight:
        q, scale = _quantize_rows(weight)
        return cls(q, scale.reshape(1, -1).contiguous())


class _Linear(NamedTuple):
    """The arguments of `F.linear` after the input, and the weight in FP8 when the engine runs
    `quantization="fp8"` (`weight` then stays the bf16 copy that weight updates write into)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    fp8: _Fp8Weight | None = None


def _apply(x: torch.Tensor, linear: _Linear) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; with an FP8 weight, the input is quantized per token
    (dynamic scales) and multiplied in FP8 (`torch._scaled_mm`, row-wise scales), output in
    x's dtype."""
    if linear.fp8 is None:
        return F.linear(x, linear.weight, linear.bias)
    rows, scale = _quantize_rows(x.reshape(-1, x.shape[-1]))
    out = torch._scaled_mm(
        rows.contiguous(),
        linear.fp8.weight.t(),
        scale_a=scale,
        scale_b=linear.fp8.scale,
        out_dtype=x.dtype,
    )
    if linear.bias is not None:
        out = out + linear.bias
    return out.view(*x.shape[:-1], -1)


def _quantized(linear: _Linear) -> _Linear:
    return linear._replace(fp8=_Fp8Weight.of(linear.weight.detach()))


class _Norm(NamedTuple):
    """An RMSNorm's weight and epsilon."""

    weight: torch.Tensor
    eps: float


def _rms_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    # Same casts as the HF Llama/Qwen RMSNorm (fp32 statistics, weight applied in x's dtype), so
    # bf16 rounding matches too.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps)
    return norm.weight * normed.to(x.dtype)


def _norm(module: torch.nn.Module) -> _Norm:
    return _Norm(module.get_parameter("weight"), cast(float, module.variance_epsilon))


def _concat_in_place(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors), whose parts then become views of it (`.data` re-pointed; same tensor
    objects), so that in-place writes to them reach it. If they already are consecutive parts
    of one tensor (another engine fused them), that tensor is returned as it is."""
    first, rows = tensors[0], sum(t.shape[0] for t in tensors)
    offsets = [first.storage_offset()]
    for t in tensors[:-1]:
        offsets.append(offsets[-1] + t.numel())
    if all(
        t.is_contiguous()
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and t.storage_offset() == offset
        for t, offset in zip(tensors, offsets, strict=True)
    ):
        return first.as_strided((rows, *first.shape[1:]), first.stride())
    fused = torch.cat(list(tensors))
    for tensor, part in zip(tensors, fused.split([t.shape[0] for t in tensors]), strict=True):
        tensor.data = part
    return fused


def _fuse(modules: Sequence[torch.nn.Module]) -> _Linear:
    """One linear whose output is the concatenation of the outputs of `modules` (nn.Linear).

    Their parameters become views of the fused tensors (see `_concat_in_place`), so an in-place
    copy into them, as `update_weights` does, updates the fused weight too, and no second copy
    of the weights is kept. One matmul instead of three (q, k, v) or two (gate, up) per layer
    saves per-op overhead on small batches and lets the BLAS run larger tiles.
    """
    linears = [cast(torch.nn.Linear, m) for m in modules]
    weight = _concat_in_place([m.weight for m in linears])
    if linears[0].bias is None:
        return _Linear(weight, None)
    return _Linear(weight, _concat_in_place([m.bias for m in linears]))


def _linear(module: torch.nn.Module) -> _Linear:
    linear = cast(torch.nn.Linear, module)
    return _Linear(linear.weight, linear.bias)
