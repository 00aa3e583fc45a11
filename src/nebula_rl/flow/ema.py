"""What a world-model checkpoint holds besides the optimiser and the schedule, the weight
averages (`train.ema_enable`, :class:`~nebula_rl.policy.ema.WeightEMA`, shared with language
models) among it. A world model's exports hold the averages (`applied`), as cosmos-rl exports
them. Works on FSDP2 shards alike: each rank averages its own.
"""

from __future__ import annotations

from torch import nn

from nebula_rl.policy.ema import WeightEMA

__all__ = ["FlowTrainingState", "WeightEMA"]


class FlowTrainingState(nn.Module):
    """What a world-model checkpoint holds besides the optimiser and the schedule: the model,
    DiffusionNFT's old weights, the KL reference when it is reset during the run (else it is
    the starting weights, made again), the weight averages (as buffers, FSDP2 shards alike)."""

    def __init__(
        self,
        model: nn.Module,
        old: nn.Module | None,
        ema: WeightEMA | None,
        *,
        reference: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        if old is not None:
            self.old = old
        if reference is not None:
            self.reference = reference
        for i, average in enumerate(ema.averages if ema is not None else []):
            self.register_buffer(f"ema_{i}", average)
