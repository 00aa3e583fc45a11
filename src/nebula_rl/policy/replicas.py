"""Data parallelism across policy replicas: one optimiser step over the union of their batches.

Each policy replica is its own process group (its ranks), so replicas cannot share a DDP/FSDP
world. They are joined instead by a group that meets in the job's Redis
(:func:`nebula_rl.weights.build_group`), and :class:`ReplicaGroup` does what DDP would across it:

- `sum_` adds up small tensors (token counts for the loss normaliser, metric sums), so every
  replica normalises by the global count; `max_` agrees on a number (the step's updates);
- `all_reduce_grads` sums the gradients in flat buckets after the local backward passes, so
  every replica applies the same update and the parameters stay identical.

With the global normaliser and summed gradients, N replicas with batches b_1..b_N step exactly as
one replica with the concatenated batch would (up to floating-point summation order); the test
`test_two_replicas_step_like_one` checks it.

Membership changes. The group is rebuilt among the live replicas whenever one leaves or joins (a
new generation, see :class:`~nebula_rl.weights.group.Generation`). The members of a new group
first agree on one state with :meth:`ReplicaGroup.sync_state`: the replica with the newest clean
state (weights, optimiser and schedule, and the policy version) sends it to the others, so a
joining replica starts from the live ones' state and survivors of a step that failed half-way
agree again. A collective that fails raises :class:`CollectiveError`.

Replicas of several ranks: each local rank `i` of every replica is in one such group (ranks `i`
hold the same shards of the same layout), so gradients and training state move shard by shard,
as their local tensors, never gathered.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from nebula_rl.policy.ema import WeightEMA
from nebula_rl.weights.group import WeightGroup

__all__ = ["CollectiveError", "DataParallelSums", "GroupsLost", "ReplicaGroup"]

# Gradient bucket size: large enough that the per-call cost vanishes, small enough that the
# flat copy is a small fraction of the model.
BUCKET_BYTES = 32 * 2**20


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (an alias: writing it writes the DTensor), else `tensor`."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _to_local_state(state: Any) -> Any:
    """An optimizer state dict with every DTensor replaced by its local shard (to pickle)."""
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: _to_local_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_local_state(v) for v in state]
    return state


def _from_local_state(state: dict[str, Any], params: list[nn.Parameter]) -> dict[str, Any]:
    """The inverse of `_to_local_state` for `optimizer.state_dict()`'s layout: a per-parameter
    state tensor shaped like the parameter's shard becomes a DTensor laid out like it."""
    for index, values in state["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in values.items():
            if isinstance(value, Tensor) and value.shape == param.to_local().shape:
                values[key] = DTensor.from_local(
                    value.to(param.device),
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                )
    return state


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _replica_wide(
    method: Callable[Concatenate[ReplicaGroup, _P], _T],
) -> Callable[Concatenate[ReplicaGroup, _P], _T]:
    """A public method of `ReplicaGroup` whose outcome the replica's ranks agree on (see
    `ReplicaGroup._agreed`)."""

    @functools.wraps(method)
    def agreed(self: ReplicaGroup, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with self._agreed():
            return method(self, *args, **kwargs)

    return agreed


class CollectiveError(RuntimeError):
    """A collective between policy replicas failed or timed out (a replica died or hangs)."""


class GroupsLost(RuntimeError):
    """What some groups of the step need is gone (a world model's trajectories, with the rollout
    replica that held them): every rank of every replica raises it together, before training,
    and the controller takes the step back and has those prompts sampled again."""

    def __init__(self, prompt_ids: list[str]) -> None:
        super().__init__(f"{len(prompt_ids)} group(s) of the step are lost: {prompt_ids[:8]}")
        self.prompt_ids = prompt_ids


class ReplicaGroup:
    """Sum tensors and gradients over the policy replicas of one job (rank = replica rank).

    Replicas of several ranks: `siblings` is a gloo group of this replica's ranks. Each public
    method (`@_replica_wide`) then ends with the siblings agreeing whether any of them failed its
    part, and all raise `CollectiveError` if one did: otherwise a rank whose peer replica died in
    the middle of a step would go on to the replica's next collective (an FSDP all-gather) while
    its sibling, whose part failed, waits elsewhere, and both would hang. (The methods are called
    as often on every rank; the collectives inside them need not be: a pipeline stage has its own
    number of gradient buckets.)
    """

    def __init__(self, group: WeightGroup, *, siblings: dist.ProcessGroup | None = None) -> None:
        self.group, self.siblings = group, siblings
        self._buckets: dict[torch.dtype, Tensor] = {}
        self._depth = 0

    @contextmanager
    def _agreed(self) -> Iterator[None]:
        """Run a public method's collectives; with siblings, agree on its outcome at the end."""
        self._depth += 1
        failed: CollectiveError | None = None
        try:
            yield
        except CollectiveError as err:
            failed = err
        finally:
            self._depth -= 1
        if self._depth == 0 and self.siblings is not None:
            flag = torch.tensor([int(failed is not None)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.siblings)
            if flag.item() and failed is None:
                failed = CollectiveError(
                    f"policy replica group {self.group.rdzv.name}: another rank of this "
                    "replica failed its part of the collective"
                )
        if failed is not None:
            raise failed

    @property
    def size(self) -> int:
        """Number of policy replicas."""
        return self.group.world_size

    @property
    def rank(self) -> int:
        """This replica's rank; rank 0 pushes weights to the rollouts."""
        return self.group.rank

    def _allreduce(self, tensor: Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> None:
        try:
            self.group.pg.allreduce(tensor, op, self.group.timeout).wait()
        except RuntimeError as err:
            raise CollectiveError(f"policy replica group {self.group.rdzv.name}: {err}") from err

    def _broadcast(self, tensor: Tensor, source: int) -> None:
        try:
            self.group.pg.broadcast(tensor, source, self.group.timeout).wait()
        except RuntimeError as err:
            raise CollectiveError(f"policy replica group {self.group.rdzv.name}: {err}") from err

    @_replica_wide
    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every replica's `values` (same length everywhere), by rank."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.group.device)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            self.group.pg.allgather(rows, mine, self.group.timeout).wait()
        except RuntimeError as err:
            raise CollectiveError(f"policy replica group {self.group.rdzv.name}: {err}") from err
        return [r.tolist() for r in rows]

    @_replica_wide
    def broadcast_tensors(self, tensors: Iterable[Tensor], source: int) -> None:
        """Overwrite `tensors` (in the same order on every replica) with rank `source`'s."""
        for tensor in map(_local, tensors):
            staged = tensor.detach().to(self.group.device)
            self._broadcast(staged, source)
            if staged is not tensor:
                with torch.no_grad():
                    tensor.copy_(staged)

    @_replica_wide
    def broadcast_object(self, obj: Any, source: int) -> Any:
        """Rank `source`'s `obj` (tensors, numbers, strings, lists and dicts of them), on every
        replica; the others' `obj` is ignored."""
        payload = torch.empty(0, dtype=torch.uint8)
        if self.rank == source:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.group.device)
        self._broadcast(size, source)
        if self.rank != source:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        staged = payload.to(self.group.device)
        self._broadcast(staged, source)
        if self.rank == source:
            return obj
        return torch.load(io.BytesIO(staged.cpu().numpy().tobytes()), weights_only=True)

    @_replica_wide
    def sync_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        version: int,
        clean: bool,
        ema: WeightEMA | None = None,
    ) -> int:
        """Make every replica's training state that of the newest clean one; returns its version.

        `version` is the last step this replica's state includes; `clean` is False when a step
        failed half-way through its optimiser updates. When all replicas report the same version
        and are clean, nothing moves (they are identical by construction); otherwise the
        lowest-ranked clean replica of the highest version sends its weights, optimiser state
        and schedule (and the weight averages, `ema`). Raises `CollectiveError` if no replica is
        clean.
        """
        reports = self.gather_ints([version, int(clean)])
        clean_versions = [(v, -r) for r, (v, ok) in enumerate(reports) if ok]
        if not clean_versions:
            raise CollectiveError(
                "no policy replica holds a consistent training state (every one failed in the "
                "middle of a step's optimiser updates); resume the job from a checkpoint"
            )
        best, neg_rank = max(clean_versions)
        if all(ok and v == best for v, ok in reports):
            return best
        source = -neg_rank
        averages = ema.averages if ema is not None else []
        self.broadcast_tensors([*model.parameters(), *model.buffers(), *averages], source)
        state = self.broadcast_object(
            {
                "optimizer": _to_local_state(optimizer.state_dict()),
                "scheduler": scheduler.state_dict(),
                "ema_steps": ema.steps if ema is not None else 0,
            },
            source,
        )
        if self.rank != source:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            optimizer.load_state_dict(_from_local_state(state["optimizer"], params))
            scheduler.load_state_dict(state["scheduler"])
            if ema is not None:
                ema.steps = state["ema_steps"]
        optimizer.zero_grad(set_to_none=True)
        return best

    def sum_(self, values: Tensor) -> Tensor:
        """Sum `values` over the replicas, in place (moved to the group's device and back)."""
        return self._reduce_(values, ReduceOp.SUM)

    def max_(self, values: Tensor) -> Tensor:
        """Elementwise maximum of `values` over the replicas, in place."""
        return self._reduce_(values, ReduceOp.MAX)

    @_replica_wide
    def _reduce_(self, values: Tensor, op: ReduceOp.RedOpType) -> Tensor:
        if values.device == self.group.device:
            self._allreduce(values, op)
            return values
        staged = values.to(self.group.device)
        self._allreduce(staged, op)
        values.copy_(staged)
        return values

    @_replica_wide
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
            by_kind.setdefault(p.grad.dtype, []).append(_local(p.grad))
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

    @property
    def size(self) -> int:
        """Data-parallel ranks in the group."""
        return dist.get_world_size(self.group)

    def sum_(self, values: Tensor) -> Tensor:
        """Sum `values` over the group's ranks, in place (staged on the GPU for NCCL)."""
        return self._reduce_(values, dist.ReduceOp.SUM)

    def max_(self, values: Tensor) -> Tensor:
        """Elementwise maximum of `values` over the group's ranks, in place."""
        return self._reduce_(values, dist.ReduceOp.MAX)

    def _reduce_(self, values: Tensor, op: dist.ReduceOp.RedOpType) -> Tensor:
        if dist.get_backend(self.group) != "nccl":
            dist.all_reduce(values, op=op, group=self.group)
            return values
        staged = values.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(staged, op=op, group=self.group)
        return values.copy_(staged)
