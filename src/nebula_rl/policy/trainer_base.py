"""What both kinds of `PolicyTrainer` update share: the model, its optimiser, LR schedule and
EMA, the reference model, sums over data-parallel ranks and replicas, and the optimiser update."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from nebula_rl.config import Config, GrpoConfig
from nebula_rl.models import resolve_dtype
from nebula_rl.policy.batching import TokenBatch, pad_batch
from nebula_rl.policy.ema import WeightEMA
from nebula_rl.policy.forward import _Forward
from nebula_rl.policy.loss_settings import _check_context_parallel_loss, loss_settings
from nebula_rl.policy.optim import build_optimizer, lr_lambda
from nebula_rl.policy.parallelize import ParallelModel, total_grad_norm
from nebula_rl.policy.replicas import DataParallelSums, ReplicaGroup
from nebula_rl.policy.setup import compute_dtype


def _chunks(n: int, size: int) -> Iterator[list[int]]:
    for start in range(0, n, size):
        yield list(range(start, min(n, start + size)))


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (or its replicate) manages `model`'s parameters, and so its precision."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


class _TrainerBase:
    """A `PolicyTrainer`'s state (its arguments: see there) and the pieces of a step that both
    updates use."""

    def __init__(
        self,
        model: nn.Module | ParallelModel,
        cfg: Config,
        *,
        total_steps: int,
        pad_id: int,
        ref_model: nn.Module | ParallelModel | None = None,
        replicas: ReplicaGroup | None = None,
        data_parallel: DataParallelSums | None = None,
    ) -> None:
        self.parallel = model if isinstance(model, ParallelModel) else None
        self.model: nn.Module = model.module if isinstance(model, ParallelModel) else model
        """This rank's modules (under PP, its stages' layers; parameters keep their names)."""
        self.cfg, self.pad_id = cfg, pad_id
        self.replicas = replicas
        if data_parallel is None and self.parallel is not None and self.parallel.dp_size > 1:
            data_parallel = DataParallelSums(self.parallel.mesh["dp"].get_group())
        self.data_parallel = data_parallel
        t = cfg.train
        self.compute_dtype = (
            self.parallel.compute_dtype
            if self.parallel is not None
            else compute_dtype(t, sharded=_sharded(self.model))
        )
        self.logprob_dtype = resolve_dtype(t.logprob_dtype)
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t, total_steps)
        )
        self.ema = (
            WeightEMA(self.model, decay=t.ema_decay, interval=t.ema_update_step_interval)
            if t.ema_enable
            else None
        )
        """`train.ema_enable`: the averages of this rank's share of the weights, moved after
        each optimiser update (`policy/ema.py`)."""
        self.device = next(self.model.parameters()).device
        self.eos_token_ids = _eos_ids(self.model)
        self._policy = _Forward(self.model, self.parallel, self.compute_dtype)
        self._reference: _Forward | None = None
        self.ref_model: nn.Module | None = None
        if isinstance(ref_model, ParallelModel):
            self.ref_model = ref_model.module
            self._reference = _Forward(ref_model.module, ref_model, ref_model.compute_dtype)
        elif ref_model is not None:
            self.ref_model = ref_model
            self._reference = _Forward(ref_model, None, self.compute_dtype)
        self.planned_updates: int | None = None
        """Optimiser updates the step in progress (or the last one) takes, once every replica
        agreed on it; None before."""
        if isinstance(t.train_policy, GrpoConfig) and self.parallel and self.parallel.dims.cp > 1:
            _check_context_parallel_loss(loss_settings(cfg), t.train_policy)

    @property
    def dp_rank(self) -> int:
        """This rank's share of an RL step's sequences (rows dp_rank::dp_size of each slice)."""
        return 0 if self.parallel is None else self.parallel.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of this replica (1 without a ParallelModel)."""
        return 1 if self.parallel is None else self.parallel.dp_size

    # -- collectives over data-parallel ranks and replicas -----------------------------------------

    def _global_sums(self, *values: float) -> list[float]:
        """`values` summed over the data-parallel ranks of this replica and over the replicas."""
        totals = torch.tensor(values, dtype=torch.float64)
        if self.data_parallel is not None:
            self.data_parallel.sum_(totals)
        if self.replicas is not None:
            self.replicas.sum_(totals)
        return totals.tolist()

    def _global_max(self, value: int) -> int:
        """The largest `value` over the data-parallel ranks and replicas."""
        top = torch.tensor([value], dtype=torch.float64)
        if self.data_parallel is not None:
            self.data_parallel.max_(top)
        if self.replicas is not None:
            self.replicas.max_(top)
        return int(top.item())

    def _num_ranks(self) -> int:
        """Ranks whose gradients are summed into one update (data-parallel x replicas)."""
        ranks = 1 if self.data_parallel is None else self.data_parallel.size
        return ranks * (1 if self.replicas is None else self.replicas.size)

    def _loss_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics of the losses this rank computed, made its data-parallel rank's (CP shards
        summed, PP's last stage's on every stage)."""
        return values if self.parallel is None else self.parallel.gather_loss_metrics(values)

    # -- pieces of a step ------------------------------------------------------------------------

    def _optimizer_step(self) -> float:
        if self.parallel is not None:
            self.parallel.reduce_tied_grads()
        if self.replicas is not None:
            self.replicas.all_reduce_grads(self.model.parameters())
        clip = self.cfg.train.optm_grad_norm_clip
        max_norm = clip if clip > 0 else float("inf")
        if self.parallel is not None:
            norm = self.parallel.clip_grad_norm_(max_norm)
        else:
            params = [p for p in self.model.parameters() if p.grad is not None]
            total = total_grad_norm([p.grad for p in params if p.grad is not None])
            if max_norm < float("inf"):
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
            norm = float(total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step()
        return norm

    def _in_step(self, plan: list[list[list[int]]]) -> list[list[list[int]]]:
        """`plan` (forward passes per update) padded with empty passes to the largest count
        over the data-parallel ranks: FSDP and DDP pair their collectives up pass by pass, so
        every rank runs as many (an empty pass runs a dummy row that carries no loss)."""
        if self.data_parallel is None or self.data_parallel.size == 1:
            return plan
        counts = torch.tensor([len(passes) for passes in plan], dtype=torch.float64)
        self.data_parallel.max_(counts)
        return [
            passes + [[] for _ in range(int(n) - len(passes))]
            for passes, n in zip(plan, counts.tolist(), strict=True)
        ]

    def _dummy(self, width: int) -> tuple[TokenBatch, Tensor]:
        """One row of padding without targets and its (zero) labels of `width` channels."""
        mb = pad_batch([([self.pad_id] * 2, [0, 0], [0.0, 0.0])], torch.zeros(1), self.pad_id)
        return mb, torch.zeros((1, 2, width))
