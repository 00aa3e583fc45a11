"""What runs inside vLLM's workers: the weight loader of a vLLM rollout engine.

vLLM imports this module in every worker it starts (`worker_extension_cls`), in the engine's own
process too when it runs in-process, before the model loads, and mixes :class:`WeightLoader`
into its worker class, so `collective_rpc("load_named_weights", ...)` reaches every worker.

On CPU, vLLM repacks each linear layer's weight after loading (into a oneDNN handle, or
sgl-kernel's layout) and drops the tensor: `load_weights` then has nothing to write into, and
`reload_weights` rebuilt the layers wrongly here (log-probs 1.5 nats off the new weights on a
tiny Qwen2). :func:`keep_cpu_linear_weights` keeps vLLM's own unpacked fallback (torch's
`linear` over the live weight) on CPU, so that updates write the weights in place. GPU builds
keep their weights as tensors and are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nebula_rl.rollout.shared_weights import Manifest, mapped_tensors

__all__ = ["WeightLoader", "keep_cpu_linear_weights"]

_patched = False


def keep_cpu_linear_weights() -> None:
    """On vLLM's CPU platform, linear layers (and a tied LM head) compute with `F.linear` over
    their live weight instead of a packed copy made at load time. Idempotent."""
    global _patched
    from vllm.platforms import current_platform

    if _patched or not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils

    packed = utils.dispatch_cpu_unquantized_gemm

    def unpacked(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:  # (not a plain linear layer: vLLM's own way)
            packed(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]

    utils.dispatch_cpu_unquantized_gemm = unpacked
    _patched = True


keep_cpu_linear_weights()


class WeightLoader:
    """Mixed into each vLLM worker: loads Hugging Face-named tensors into its model."""

    model_runner: Any
    _shared_views: dict[str, list[tuple[str, torch.Tensor]]]

    def load_shared_weights(self, path: str, manifest: Manifest, keep: bool) -> int:
        """Load the tensors of `manifest` from the shared-memory file at `path`
        (:mod:`nebula_rl.rollout.shared_weights`): vLLM's loaders read this worker's slices of
        them and nothing else. With `keep`, the mapping is kept for the next update of the same
        file, which has the same manifest (the writer unlinks its name after the first); the
        number of tensors loaded."""
        cache = self.__dict__.setdefault("_shared_views", {})
        views = cache.get(path)
        if views is None:
            views = mapped_tensors(path, manifest)
            if keep:
                cache[path] = views
        return self.load_named_weights(views)

    def load_named_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy `weights` (names as in the Hugging Face checkpoint, whole tensors) into this
        worker's model through vLLM's own loaders, which fuse q/k/v and gate/up and cut this
        worker's tensor-parallel slices; the number of tensors loaded."""
        loaded = self.model_runner.model.load_weights(weights=list(weights))
        return len(loaded) if loaded is not None else 0
