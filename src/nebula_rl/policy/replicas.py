"""Data parallelism across policy replicas: one optimiser step over the union of their batches.

Each policy replica is its own process group (its own `torchrun`), so replicas cannot share a
DDP/FSDP world. They are joined instead by a group built from a controller-served rendezvous
(:func:`nebula_rl.weights.build_group`), and :class:`ReplicaGroup` does what DDP would across it:

- `sum_` adds up small tensors (token counts for the loss normaliser, metric sums), so every
  replica normalises by the global count;
- `all_reduce_grads` sums the gradients in flat buckets after the local backward passes, so
  every replica applies the same update and the parameters stay identical.

With the global normaliser and summed gradients, N replicas with batches b_1..b_N step exactly as
one replica with the concatenated batch would (up to floating-point summation order); the test
`test_two_replicas_step_like_one` checks it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ReduceOp

from nebula_rl.weights.group import WeightGroup

__all__ = ["DataParallelSums", "ReplicaGroup"]

# Gradient bucket size: large enough that the per-call cost vanishes, small enough that the
# flat copy is a small fraction of the model.
BUCKET_BYTES = 32 * 2**20


class ReplicaGroup:
    """Sum tensors and gradients over the policy replicas of one job (rank = replica rank)."""

    def __init__(self, group: WeightGroup) -> None:
        self.group = group
        self._buckets: dict[torch.dtype, Tensor] = {}

    @property
    def size(self) -> int:
        """Number of policy replicas."""
        return self.group.world_size

    @property
    def rank(self) -> int:
        """This replica's rank; rank 0 pushes weights to the rollouts."""
        return self.group.rank

    def _allreduce(self, tensor: Tensor) -> None:
        self.group.pg.allreduce(tensor, ReduceOp.SUM, self.group.timeout).wait()

    def sum_(self, values: Tensor) -> Tensor:
        """Sum `values` over the replicas, in place (moved to the group's device and back)."""
        if values.device == self.group.device:
            self._allreduce(values)
            return values
        staged = values.to(self.group.device)
        self._allreduce(staged)
        values.copy_(staged)
        return values

    def all_reduce_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Replace each trainable parameter's gradient by its sum over the replicas.

        A parameter without a gradient here contributes zeros (another replica's batch may
        have reached it), so every replica ends with a gradient for every trainable parameter.
        """
        trainable = [p for p in params if p.requires_grad]
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_kind: dict[torch.dtype, list[Tensor]] = {}
        for p in trainable:
            assert p.grad is not None
            by_kind.setdefault(p.grad.dtype, []).append(p.grad)
        for dtype, grads in by_kind.items():
            limit = max(1, BUCKET_BYTES * 8 // torch.finfo(dtype).bits)
            bucket: list[Tensor] = []
            filled = 0
            for grad in grads:
                if bucket and filled + grad.numel() > limit:
                    self._reduce_bucket(bucket, dtype)
                    bucket, filled = [], 0
                bucket.append(grad)
                filled += grad.numel()
            if bucket:
                self._reduce_bucket(bucket, dtype)

    def _reduce_bucket(self, grads: list[Tensor], dtype: torch.dtype) -> None:
        numel = sum(g.numel() for g in grads)
        flat = self._buckets.get(dtype)
        if flat is None or flat.numel() < numel:  # reused across steps: no fresh memory per step
            flat = torch.empty(numel, dtype=dtype, device=self.group.device)
            self._buckets[dtype] = flat
        view = flat[:numel]
        offset = 0
        for g in grads:
            view[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        self._allreduce(view)
        offset = 0
        for g in grads:
            g.copy_(view[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def close(self) -> None:
        """Tear the group down."""
        self.group.close()


class DataParallelSums:
    """Sums over the data-parallel ranks inside one replica (a torch.distributed group of the
    replica's own world). Only counts and metrics: FSDP2 or DDP already sum the gradients."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def sum_(self, values: Tensor) -> Tensor:
        """Sum `values` over the group's ranks, in place (staged on the GPU for NCCL)."""
        if dist.get_backend(self.group) != "nccl":
            dist.all_reduce(values, group=self.group)
            return values
        staged = values.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(staged, group=self.group)
        return values.copy_(staged)
