"""Rollout generation: the `Engine` interface, its request and result types, the built-in
`TorchEngine` and vLLM's, the rollout worker.

Other backends (vLLM) are reached through `engine_class(name)` only, so importing
this package never imports them."""

from nebula_rl.rollout.engine import (
    Completion,
    Engine,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    engine_class,
)
from nebula_rl.rollout.torch_engine import TorchEngine

__all__ = [
    "Completion",
    "Engine",
    "GenerationRequest",
    "RequestOutput",
    "SamplingParams",
    "TorchEngine",
    "engine_class",
]
