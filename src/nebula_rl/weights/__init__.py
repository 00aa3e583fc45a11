"""Moving parameters between replicas.

Process groups between separately started processes
(`group`), a bucketed, non-blocking broadcast from the policy to rollouts (`transport`), slices
between parallel layouts (`reshard`) and the shared memory both use on one host (`shared`)."""

from nebula_rl.weights.group import (
    Rendezvous,
    WeightGroup,
    build_group,
    free_port,
    serve_store,
    weight_backend,
)
from nebula_rl.weights.transport import (
    BucketLayout,
    LayoutMismatchError,
    PushHandle,
    PushStats,
    Slot,
    WeightReceiver,
    WeightSender,
)

__all__ = [
    "BucketLayout",
    "LayoutMismatchError",
    "PushHandle",
    "PushStats",
    "Rendezvous",
    "Slot",
    "WeightGroup",
    "WeightReceiver",
    "WeightSender",
    "build_group",
    "free_port",
    "serve_store",
    "weight_backend",
]
