"""`[train]`: the optimiser, precision, schedule, checkpoints, FP8/FP4 and the run's outputs."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from nebula_rl.config.algorithm import GrpoConfig, TrainPolicy
from nebula_rl.config.base import NEEDS_CUDA, NO_UPLOAD, Dtype, Section, refused


class CheckpointConfig(Section):
    """Checkpoints (torch.distributed.checkpoint) and Hugging Face safetensors exports."""

    enable_checkpoint: bool = False
    """Save resumable checkpoints every `save_freq` steps."""
    save_freq: int = Field(default=20, ge=1)
    """Steps between checkpoints."""
    save_freq_in_epoch: int = Field(default=0, ge=0)
    """Epochs between checkpoints, saved after an epoch's last step instead of every `save_freq`
    steps (0: off, `save_freq` counts)."""
    save_mode: Literal["async", "sync"] = "async"
    """Write checkpoints in the background (`async`) or block the step (`sync`)."""
    max_keep: int = Field(default=5, ge=-1)
    """Checkpoints kept on disk; -1 keeps all."""
    export_safetensors: bool = True
    """Also export HF safetensors (`safetensors/step_N/`, and `safetensors/final/` at the end)."""
    upload_hf: bool = Field(default=False, json_schema_extra=refused(NO_UPLOAD))
    """Upload exports to the Hugging Face Hub."""
    hf_repo_name: str = Field(default="Comos-Reason1", json_schema_extra=refused(NO_UPLOAD))
    """Hub repository of the uploads."""
    upload_s3: bool | Literal["final", "all"] = False
    """Upload checkpoints with their safetensors exports to S3-compatible storage, in the
    background: `all` (or true) every checkpoint (and remove what `max_keep` removes), `final`
    the last one. Credentials from `PROD_S3_CHECKPOINT_*` or `AWS_*` (docs/storage.md);
    `resume = true` with no local run resumes from the newest uploaded checkpoint."""
    s3_bucket: str | None = None
    """S3 bucket of the uploads."""
    s3_prefix: str = "outputs"
    """S3 prefix of the uploads (a run's under `<prefix>/<run folder name>/`)."""
    s3_log_interval_s: float = Field(default=300.0, ge=0.0)
    """With `upload_s3`: seconds between copies of the run folder's logs and metrics
    (metrics.jsonl, logs/, TensorBoard events, samples; the files that changed) to the store
    while training runs, besides the copies made with each upload and at the end (0: only
    those)."""

    @field_validator("max_keep")
    @classmethod
    def _keep_some(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (keep all) or at least 1")
        return v

    @model_validator(mode="after")
    def _upload_needs(self) -> CheckpointConfig:
        if self.upload_s3 and not self.s3_bucket:
            raise ValueError("upload_s3 needs s3_bucket (the bucket the checkpoints go to)")
        if self.upload_s3 and not self.enable_checkpoint:
            raise ValueError("upload_s3 uploads checkpoints: set enable_checkpoint = true too")
        return self

    def due(self, step: int, *, last: bool, steps_per_epoch: int) -> bool:
        """Whether to checkpoint after `step` (1-based) with `enable_checkpoint`: every
        `save_freq` steps, or with `save_freq_in_epoch` after the last step of every that many
        epochs of `steps_per_epoch` steps (the run's steps per epoch: the dataset's rows over a
        step's rows, as `train.epoch` counts them); and after the run's last step (`last`)."""
        if not self.enable_checkpoint:
            return False
        if last:
            return True
        if self.save_freq_in_epoch > 0:
            return step % (self.save_freq_in_epoch * max(steps_per_epoch, 1)) == 0
        return step % self.save_freq == 0


class FP8Config(Section):
    """FP8 training through torchao (cosmos-rl's `train.fp8`)."""

    enable_fp8: bool = False
    """Train the decoder's linear layers in FP8 (torchao's Float8Linear; CUDA GPUs of compute
    capability 8.9+, language models; the LM head and the parameters keep their dtypes).
    torchao fuses its casts under `train.compile`."""
    fp8_recipe: Literal["dynamic_scaling", "delayed_scaling"] = Field(
        default="dynamic_scaling",
        json_schema_extra=refused(
            "torchao scales FP8 dynamically (from each tensor's current values) only; its "
            "delayed scaling was removed"
        ),
    )
    """Scale recipe: `dynamic_scaling` (scales from each tensor's current absolute maximum)."""
    quant_recipe: Literal["rowwise", "tensorwise"] = "rowwise"
    """Scale granularity: `rowwise` (a scale per row, torchao's more accurate recipe) or
    `tensorwise` (one per tensor, torchao's faster one)."""


class FP4Config(Section):
    """FP4 training (cosmos-rl's `train.fp4`)."""

    enable_fp4: bool = Field(
        default=False, json_schema_extra=refused("FP4 training is not supported")
    )
    """Train in FP4."""
    fp4_recipe: str = Field(
        default="dynamic_scaling", json_schema_extra=refused("FP4 training is not supported")
    )
    """Scale recipe."""
    quant_recipe: str = Field(
        default="rowwise", json_schema_extra=refused("FP4 training is not supported")
    )
    """Quantisation."""


class TrainingConfig(Section):
    """The optimiser, precision, schedule and the run's outputs."""

    train_policy: TrainPolicy = Field(default_factory=GrpoConfig)
    """Training mode: `[train.train_policy] type = "grpo"` or `"sft"`."""
    optm_name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimiser."""
    optm_lr: float | dict[str, float] = 1e-6
    """Peak learning rate; a table gives module-path prefixes their own rate and must have a
    `global` entry for the rest (e.g. `{ global = 1e-6, "model.embed_tokens" = 1e-7 }`)."""
    optm_impl: Literal["fused", "foreach", "for-loop"] = "fused"
    """Optimiser kernel implementation."""
    optm_weight_decay: float = Field(default=0.01, ge=0.0)
    """Decoupled weight decay."""
    optm_betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    optm_warmup_steps: int | float = Field(default=20, ge=0)
    """Linear warm-up steps; a float in [0, 1] is a fraction of the total steps."""
    optm_warmup_start_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    """Learning rate at the first warm-up step, as a fraction of `optm_lr`."""
    optm_decay_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fraction of the total steps, at the end, over which the rate decays (warm-up, stable,
    decay); None decays over every step after warm-up."""
    optm_decay_type: Literal["none", "linear", "cosine", "sqrt"] | None = None
    """Decay shape (None or `none`: constant after warm-up)."""
    optm_min_lr_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    """Floor of the decayed learning rate as a fraction of `optm_lr`."""
    optm_grad_norm_clip: float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables."""
    ema_enable: bool = False
    """Keep an exponential moving average of the trained weights, exported beside them
    (language models: `safetensors/final_ema`; world models export it in their place) and
    saved in checkpoints (docs/ema.md)."""
    ema_decay: float = Field(default=0.9999, ge=0.0, le=1.0)
    """EMA decay; optimiser step t uses min((1 + t) / (10 + t), ema_decay)."""
    ema_update_step_interval: int = Field(default=0, ge=0)
    """Optimiser steps between EMA updates (0: every step)."""
    master_dtype: Dtype = "float32"
    """Dtype of the weights and optimiser state the optimiser updates (the master copy)."""
    param_dtype: Dtype = "float32"
    """Compute dtype of forward and backward; lower than `master_dtype` is mixed precision
    (autocast, or FSDP2's mixed precision when sharded)."""
    transfer_dtype: Dtype | None = None
    """Dtype of the weights pushed to rollouts; defaults to `master_dtype`."""
    logprob_dtype: Dtype = "float32"
    """Dtype the logits are cast to before the log-softmax of the loss."""
    fsdp_reduce_dtype: Literal["float32"] = "float32"
    """FSDP2: dtype of the gradient reduction."""
    fsdp_offload: bool = False
    """FSDP2: keep the sharded parameters and optimiser state in CPU memory (CUDA only)."""
    fsdp_reshard_after_forward: Literal["always", "never", "default"] = "default"
    """FSDP2: free the gathered parameters after forward (`default`: torch's default, every
    decoder block but not the root; none under pipeline parallelism)."""
    train_batch_per_replica: int = Field(default=8, ge=1)
    """Samples per optimiser step on each policy replica: completions for RL (whole groups: a
    value that is not a multiple of `rollout.n_generation` is rounded up to one), conversations
    per data-parallel rank for SFT."""
    fp8: FP8Config = Field(default_factory=FP8Config)
    """FP8 training."""
    fp4: FP4Config = Field(default_factory=FP4Config)
    """FP4 training."""
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    resume: bool | str = False
    """Resume from the latest checkpoint under the run folder (true) or from a path."""
    epoch: int = Field(default=1, ge=1)
    """Passes over the dataset."""
    output_dir: str = "./outputs"
    """Directory under which each run gets a folder."""
    timestamp: str = ""
    """Run folder name; generated from the start time (YYYYmmddHHMMSS) when empty."""
    epsilon: float = Field(default=1e-6, gt=0.0)
    """Adam epsilon."""
    async_tp_enabled: bool = Field(
        default=False, json_schema_extra=refused("asynchronous tensor parallelism " + NEEDS_CUDA)
    )
    """torch's asynchronous tensor parallelism (with compile)."""
    compile: bool = False
    """Compile the model's blocks with torch.compile."""
    sync_weight_interval: int = Field(default=1, ge=1)
    """Optimiser steps between weight pushes to rollout replicas."""
    coalesce_weight_sync: bool = Field(
        default=False,
        json_schema_extra=refused(
            "coalescing weight pushes is not supported yet (each push waits for the previous)"
        ),
    )
    """Drop intermediate weight versions while a push is in flight."""
    deterministic: bool = False
    """Deterministic kernels (`torch.use_deterministic_algorithms`; slower); sets `seed` to 42
    when unset."""
    activation_offload: bool = Field(
        default=False, json_schema_extra=refused("activation offloading " + NEEDS_CUDA)
    )
    """Offload activations to CPU memory."""
    fa_version: Literal[2, 3] | None = Field(
        default=None,
        json_schema_extra=refused(
            "nebula-rl uses PyTorch's scaled_dot_product_attention, not the flash-attn package"
        ),
    )
    """flash-attn version."""
    seed: int | None = 42
    """Seed for initialisation and sampling; negative values become 42."""
    local_dataset: bool = True
    """Replicas read each prompt's row from their own copy of the dataset by index (true), or the
    controller sends the prompt text and reference answer with the prompt (false)."""
    force_use_hf: bool = False
    """Run the rollout engine through the Hugging Face module's forward instead of nebula-rl's
    compact forward (cosmos-rl: the generic HF model instead of a native class)."""
    non_text: bool = Field(
        default=False,
        json_schema_extra=refused("non-text (tensor) completions are not supported yet"),
    )
    """Completions are tensors (images, videos, actions), not text."""
    max_num_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimiser steps, even within an epoch."""
    sequence_packing: bool = False
    """SFT: pack conversations into rows of up to `policy.model_max_length` tokens
    (block-diagonal attention, positions restart per conversation)."""
    save_ckpt_at_exit: bool = True
    """On a signal of `signal_to_handle` (e.g. SLURM's pre-emption warning), save a checkpoint
    after the current step and stop."""
    signal_to_handle: list[str] = Field(default_factory=lambda: ["SIGUSR1"])
    """Signals that trigger `save_ckpt_at_exit`."""

    @field_validator("optm_lr")
    @classmethod
    def _lr(cls, v: float | dict[str, float]) -> float | dict[str, float]:
        rates = v.values() if isinstance(v, dict) else [v]
        if any(r <= 0 for r in rates):
            raise ValueError("learning rates must be > 0")
        if isinstance(v, dict) and "global" not in v:
            raise ValueError("a table of learning rates needs a `global` entry")
        return v

    @field_validator("signal_to_handle")
    @classmethod
    def _signals(cls, v: list[str]) -> list[str]:
        import signal

        unknown = [s for s in v if not isinstance(getattr(signal, s, None), signal.Signals)]
        if unknown:
            raise ValueError(f"unknown signal name(s) {unknown}")
        return v

    @property
    def peak_lr(self) -> float:
        """The global learning rate (`optm_lr`, or its `global` entry)."""
        return self.optm_lr["global"] if isinstance(self.optm_lr, dict) else self.optm_lr
