"""`[policy]`: the trained model, its LoRA, and a world model's `[policy.diffusers]`."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from nebula_rl.config.base import WORLD_LORA, Dtype, Section, refused
from nebula_rl.config.parallel import ParallelismConfig


class LoraConfig(Section):
    """LoRA adapters (cosmos-rl's `policy.lora`)."""

    r: int = 8
    """Rank."""
    lora_names: list[str] = Field(default_factory=lambda: ["default"])
    """Adapter names."""
    lora_path: str | None = None
    """Pre-trained adapter weights."""
    lora_alpha: float = 8.0
    """Alpha."""
    lora_dropout: float = 0.0
    """Dropout."""
    target_modules: list[str] | str | None = None
    """Target modules, or `all-linear`."""
    primary_adapter: str | None = None
    """Adapter used for inference."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""
    modules_to_save: list[str] | None = None
    """Other trainable modules."""
    alpha_pattern: dict[str, float] | None = None
    """Per-module alpha."""
    r_pattern: dict[str, int] | None = None
    """Per-module rank."""
    init_lora_weights: bool | str = True
    """Initialisation."""


class SampleConfig(Section):
    """Diffusion sampling (cosmos-rl's `policy.diffusers.sample`)."""

    num_steps: int = 40
    """Training sampler steps."""
    eval_num_steps: int = 40
    """Evaluation sampler steps."""
    guidance_scale: float = 4.5
    """Classifier-free guidance `v_u + g (v_c - v_u)` (1: none); for a Cosmos-Predict2.5
    transformer as its pipelines read it: `v_c + g (v_c - v_u)` when g > 1, else none."""
    global_std: bool = True
    """Batch-wide reward std (false: each group's, as cosmos-rl's `--wfm-mode` and flow_grpo's
    per-prompt tracking do)."""
    population_std: bool = False
    """nebula-rl: the advantages' std over n (flow_grpo's and DiffusionNFT's numpy std) instead
    of n - 1 (cosmos-rl's torch std, the default)."""
    noise_level: float = 1.0
    """SDE noise level."""
    deterministic_sampling: bool = False
    """Deterministic sampling."""
    solver: str = "euler"
    """Solver of deterministic rollouts: `euler` (the ODE step), or `dpm2` (DPM-Solver++(2M),
    second order; cosmos-rl's default) with `deterministic_sampling`."""
    same_group_noise: bool = False
    """nebula-rl: the samples of a group (one prompt's `rollout.n_generation`) start from the same
    noise, and only the SDE's per-step noise tells them apart (cosmos-rl's `--wfm-mode`
    `model.rl.use_same_seed`); false: each sample its own starting noise."""


class DiffusersTokenizerConfig(Section):
    """The VAE of a latent-space world model (cosmos-rl's `policy.diffusers.tokenizer`); the VAE
    itself comes from the model's pipeline folder (`vae/`)."""

    chunk_duration: int = Field(
        default=81,
        json_schema_extra=refused(
            "diffusers' Wan VAE encodes and decodes a clip in one causal pass, a latent frame "
            "at a time; independent chunks would change its latents and its frame count "
            "(cosmos-rl's tokenizer keeps the value but cuts nothing either)"
        ),
    )
    """Pixel frames per chunk of cosmos-rl's tokenizer."""
    load_mean_std: bool = Field(
        default=False,
        json_schema_extra=refused(
            "cosmos-rl's per-frame latent statistics files (images_mean_std.pt, "
            "video_mean_std.pt) are not part of a diffusers pipeline; latents are normalised "
            "with the VAE config's latents_mean / latents_std"
        ),
    )
    """Load cosmos-rl's per-frame latent statistics on top of the VAE's own."""
    compile_encode: bool = False
    """Compile the VAE's encoder call (`torch.compile`; clips are encoded for SFT and DDRL's data
    term)."""
    temporal_window: int = Field(
        default=16,
        json_schema_extra=refused(
            "diffusers' Wan VAE encodes 4 frames (one latent frame) per pass through its causal "
            "cache; any other window gives the same latents, and nebula-rl does not re-drive the "
            "VAE's internals"
        ),
    )
    """Frames per pass of cosmos-rl's tokenizer encoder."""


class DiffusersConfig(Section):
    """Diffusion models (cosmos-rl's `policy.diffusers`)."""

    dtype: Dtype = Field(
        default="float32",
        json_schema_extra=refused("world models train in float32 so far"),
    )
    """Model dtype."""
    is_video: bool = False
    """Video model: samples have `inference_frames` frames (else one)."""
    max_prompt_length: int = 300
    """Text tokens of a prompt's embeddings kept (the rest are cut); with a pipeline text
    encoder (prompt datasets), the tokens its T5 encodes, padded to this length."""
    weighting_scheme: str = "logit_normal"
    """Timestep sampling."""
    train_flow_shift: float = 3.0
    """Shift of the rollout sampler's noise levels (SD3's `shift s / (1 + (shift - 1) s)`; 1:
    uniform)."""
    offload: bool = False
    """Keep a latent-space model's VAE and its pipeline text encoders on the CPU between uses,
    moved to the GPU for each pass (cosmos-rl's default is true; a CPU run never moves them)."""
    logit_mean: float = 0.0
    """Timestep logit mean."""
    logit_std: float = 1.0
    """Timestep logit std."""
    inference_size: list[int] = Field(default_factory=lambda: [1024, 1024])
    """Generation size [h, w]."""
    inference_frames: int = 41
    """Generated frames."""
    train_frames: int = 41
    """Training frames."""
    timesteps_fraction: float = 1.0
    """Fraction of timesteps trained."""
    train_on: list[int] | None = None
    """nebula-rl: the denoising steps of each rollout that RL trains, by index (0: the first, of
    `sample.num_steps`), instead of the first `timesteps_fraction` of them; each -1 adds one
    step drawn afresh every iteration from those not named (cosmos-rl's `--wfm-mode`
    `model.rl.train_on`)."""
    nft_beta: float = 1.0
    """DiffusionNFT beta."""
    weight_copy_decay_type: int = Field(default=0, ge=0, le=2)
    """DiffusionNFT's old-weight decay schedule at training step s: 0 (always 0: the old weights
    become the current ones), 1 (`min(0.001 s, 0.5)`), 2 (0 for 75 steps, then rising by
    0.0075 a step to 0.999)."""
    nft_old_update: Literal["iteration", "minibatch"] = "minibatch"
    """nebula-rl: DiffusionNFT's old weights follow after each optimiser step (of
    `train_batch_per_replica / mini_batch` a step), or once a training step, after all of them,
    as cosmos-rl's trainer does ("iteration"; docs/world-models.md compares the two)."""
    ratio_form: Literal["gaussian", "squared_error"] = "gaussian"
    """nebula-rl: FlowGRPO's per-step log-ratio: the difference of the step Gaussians'
    log-densities (flow_grpo), or cosmos-rl's `--wfm-mode` `mean(-(x' - mu)^2 + (x' - mu_old)^2)`
    without the Gaussian's 1 / (2 scale^2) ("squared_error")."""
    kl_form: Literal["gaussian", "squared_error"] = "gaussian"
    """nebula-rl: the KL of `kl_beta`: flow_grpo's `mean((mu - mu_ref)^2) / (2 std_t^2)`, or
    cosmos-rl's `--wfm-mode` `mean((mu - mu_ref)^2)` ("squared_error")."""
    detach_unconditional: bool = False
    """nebula-rl: train through classifier-free guidance's conditional branch only (the
    unconditional one detached: a cheaper backward); false trains through both, as flow_grpo
    and cosmos-rl do."""
    min_num_conditional_frames: int = Field(default=0, ge=0)
    """Fewest leading frames (of the model's samples: latent frames in latent space) given as
    conditioning, clean, to each rollout or SFT clip (cosmos-rl's
    `model.rl.min_num_conditional_frames`; nebula-rl's key)."""
    max_num_conditional_frames: int = Field(default=0, ge=0)
    """Most conditioning frames; each group (each clip in SFT) draws its count uniformly between
    the two (0: text-to-video only; 1: a run mixes text- and image-to-video, as cosmos-rl's
    DDRL recipes)."""
    lora: LoraConfig | None = Field(default=None, json_schema_extra=refused(WORLD_LORA))
    """LoRA of the diffusion model."""
    sample: SampleConfig = Field(default_factory=SampleConfig)
    """Sampling."""
    tokenizer: DiffusersTokenizerConfig = Field(default_factory=DiffusersTokenizerConfig)
    """The VAE of a latent-space model."""


class PolicyConfig(Section):
    """The model being trained."""

    model_name_or_path: str = "tiny:qwen2"
    """A Hugging Face Hub model id (`Qwen/Qwen2.5-7B-Instruct`, fetched into the usual cache),
    a local Hugging Face folder, or a built-in preset `tiny:<name>` (random init, a tokenizer
    built locally or shipped in the package: see `nebula_rl.models`)."""
    model_safetensor_path: str | None = None
    """Load the weights from these safetensors (a file or a folder of them) instead of
    `model_name_or_path`'s, which still gives the architecture and tokenizer."""
    model_revision: str | None = None
    """Hub revision of the model: a branch, tag or commit hash."""
    model_max_length: int = Field(default=4096, ge=8)
    """Longest sequence (prompt + response) in tokens; longer samples are truncated."""
    cpu_threads: int | None = Field(default=None, ge=1)
    """nebula-rl: torch's CPU threads in each policy process (`--local`: while training);
    unset: `OMP_NUM_THREADS` (the launcher's default 1 per process). When the replicas' threads
    outnumber the cores, the launcher sets `OMP_WAIT_POLICY=PASSIVE` unless it is set."""
    model_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora: LoraConfig | None = None
    """LoRA adapters (peft): only they (and `modules_to_save`) train; see docs/lora.md."""
    trainable_map: dict[str, bool] | None = None
    """Parameter or module names -> whether they train (exact names, applied after the
    patterns)."""
    freeze_pattern: list[str] | None = None
    """Regular expressions of parameter names to freeze (e.g. `'^visual\\.'`)."""
    trainable_pattern: list[str] | None = None
    """Regular expressions of the only parameter names that train (exclusive with
    `freeze_pattern`)."""
    enable_liger_kernel: bool = Field(
        default=False, json_schema_extra=refused("Liger kernels are not supported")
    )
    """Liger kernels."""
    enable_liger_cross_entropy: bool = Field(
        default=False, json_schema_extra=refused("Liger kernels are not supported")
    )
    """Liger cross entropy."""
    enable_liger_fused_cross_entropy: bool = Field(
        default=False, json_schema_extra=refused("Liger kernels are not supported")
    )
    """Liger fused cross entropy."""
    aux_loss_coeff: float = Field(
        default=0.0, json_schema_extra=refused("the MoE auxiliary loss is not supported yet")
    )
    """MoE auxiliary loss coefficient."""
    is_diffusers: bool = False
    """The model is a flow (diffusion) model of images or videos: a world-model run
    (`docs/world-models.md`); only the keys of :data:`FLOW_KEYS` apply to it."""
    diffusers: DiffusersConfig = Field(default_factory=DiffusersConfig)
    """Diffusion model settings (with `is_diffusers`)."""
    warmstart_config: str | None = None
    """nebula-rl: if `model_name_or_path` does not exist yet, first run this (SFT) config, whose
    final export must land at that path."""
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    """Policy parallelism."""

    @model_validator(mode="after")
    def _patterns(self) -> PolicyConfig:
        if self.freeze_pattern is not None and self.trainable_pattern is not None:
            raise ValueError("freeze_pattern and trainable_pattern cannot both be set")
        return self


def primary_adapter_refusals(lora: LoraConfig) -> list[str]:
    """`policy.lora.primary_adapter` names the adapter that trains (language and world models
    alike), or nothing."""
    if lora.primary_adapter is None or lora.primary_adapter == lora.lora_names[0]:
        return []
    return [
        f"policy.lora.primary_adapter = {json.dumps(lora.primary_adapter)}: must name the adapter "
        f"that trains, the first of policy.lora.lora_names ({json.dumps(lora.lora_names[0])})"
    ]
