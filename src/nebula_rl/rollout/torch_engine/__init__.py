"""The built-in generation engine: continuous batching over a paged KV cache whose prompt
blocks a GRPO group shares (`engine`: the design; the engine's parts in `state`, `finish`,
`multiturn`, `decode` and `admission`), the cache (`blocks`), the compact forward of the Llama
family (`fused`, its weights in `layers`) and the forward through any causal LM's own modules
(`hf_forward`)."""

from nebula_rl.rollout.torch_engine.engine import TorchEngine
from nebula_rl.rollout.torch_engine.model import FUSED_MODEL_TYPES, fused_forward_unsupported

__all__ = ["FUSED_MODEL_TYPES", "TorchEngine", "fused_forward_unsupported"]
