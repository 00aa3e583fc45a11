"""Flow models by name (`policy.model_name_or_path`):

- the built-in preset `tiny:dit`, or a folder nebula-rl exported of it (`config.json` with
  `"model_type": "nebula_tiny_dit"` and `model.safetensors`);
- a diffusers transformer (`nebula_rl.flow.diffusers_models`): a pipeline folder
  (`model_index.json`, `transformer/`) or transformer folder, local or a Hub id fetched into the
  Hugging Face cache (`policy.model_revision`: e.g. `diffusers/base/post-trained`), or a
  random-init miniature (`tiny:cosmos_transformer3d`, `tiny:wan_transformer3d`,
  `tiny:sd3_transformer2d`, `tiny:sana_transformer2d`, `tiny:sana_video_transformer3d`; in
  latent space with a miniature VAE, the same names ending in `_latent`, and Cosmos 3's
  generator `tiny:cosmos3_omni_generator` on a trained one). A latent-space
  transformer comes with the VAE of its pipeline folder (`vae/`, frozen: `nebula_rl.flow.vae`).

A preset's frames and frame size come from the config (`policy.diffusers.inference_frames` when
`is_video`, else 1; `inference_size`); its widths are fixed (:data:`FLOW_PRESETS`). Exports of a
diffusers model are folders diffusers loads (`from_pretrained`): the transformer's, or for a
latent-space model a pipeline folder with `transformer/` and `vae/`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nebula_rl.config import Config, GrpoConfig, PolicyConfig, SftConfig
from nebula_rl.flow.context_parallel import CP_CLASSES
from nebula_rl.flow.cosmos3 import COSMOS3_CLASS, TINY_LATENT_PATCH, Cosmos3Prompts
from nebula_rl.flow.diffusers_models import (
    DIFFUSERS_PRESETS,
    IMAGE_CLASSES,
    PRESET_VAES,
    TI2V_PRESETS,
    DiffusersFlowModel,
    check_diffusers_folder,
    diffusers_class_of,
    load_diffusers_flow_model,
    save_diffusers_flow_model,
    tiny_diffusers_flow_model,
    tiny_vae_config,
)
from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig
from nebula_rl.flow.lora import apply_lora, lora_adapter_state, merged_copy, save_adapter
from nebula_rl.flow.prompts import is_prompt_dataset
from nebula_rl.flow.text_encoder import TEXT_PIPELINES, PipelineTextEncoder, text_pipeline
from nebula_rl.flow.vae import check_vae_shape, flow_vae, vae_factors
from nebula_rl.models import resolve_dtype
from nebula_rl.utils.hub import is_hub_id

__all__ = [
    "FLOW_MODEL_TYPE",
    "FLOW_PRESETS",
    "check_flow_model",
    "flow_model_config",
    "load_flow_model",
    "needs_text_encoder",
    "save_flow_model",
]

FLOW_MODEL_TYPE = "nebula_tiny_dit"
FLOW_PRESETS: dict[str, dict[str, int]] = {
    "tiny:dit": {"patch": 4, "width": 64, "depth": 3, "heads": 4, "text_dim": 32},
}
"""Preset name -> the TinyDiT widths it fixes."""
KEY = "policy.model_name_or_path"
TOY_TEXT_DIM = 32
"""Text-embedding width of the presets (that of the toy dataset's embeddings)."""


def _shape(policy: PolicyConfig) -> tuple[int, int]:
    """(frames, size) the config asks for."""
    d = policy.diffusers
    height, width = d.inference_size
    if height != width:
        raise ValueError(
            f"policy.diffusers.inference_size = {d.inference_size}: the built-in flow model "
            "takes square frames"
        )
    frames = d.inference_frames if d.is_video else 1
    if d.is_video and d.train_frames != d.inference_frames:
        raise ValueError(
            f"policy.diffusers.train_frames ({d.train_frames}) must equal inference_frames "
            f"({d.inference_frames}): the built-in flow model has one frame count"
        )
    return frames, height


def flow_model_config(policy: PolicyConfig) -> TinyDiTConfig:
    """The architecture `policy.model_name_or_path` names, checked against the config's shape."""
    name = policy.model_name_or_path
    frames, size = _shape(policy)
    conditioning = _conditional_frames(policy, frames) > 0
    if name in FLOW_PRESETS:
        return TinyDiTConfig(
            frames=frames, size=size, conditioning=conditioning, **FLOW_PRESETS[name]
        )
    path = Path(name) / "config.json"
    if not path.is_file():
        presets = sorted([*FLOW_PRESETS, *DIFFUSERS_PRESETS])
        raise ValueError(
            f"{KEY}: {name!r} is neither a flow-model preset ({presets}), a folder exported by "
            "nebula-rl (config.json), a diffusers folder nor a Hub id"
        )
    data = json.loads(path.read_text())
    if data.pop("model_type", None) != FLOW_MODEL_TYPE:
        raise ValueError(f"{KEY}: {path} is not a nebula-rl flow model ({FLOW_MODEL_TYPE})")
    # (a model exported without conditioning gains its frame embedding, zero, when asked)
    config = TinyDiTConfig(**{**data, "conditioning": data.get("conditioning") or conditioning})
    if (config.frames, config.size) != (frames, size):
        raise ValueError(
            f"{KEY}: {name} makes {config.frames} frame(s) of {config.size} px; the config asks "
            f"for {frames} of {size} (policy.diffusers.inference_frames / inference_size)"
        )
    return config


def _conditional_frames(policy: PolicyConfig, frames: int) -> int:
    """The most conditioning frames `policy` asks for, checked against the `frames` of a sample
    (at least one must be generated)."""
    most = policy.diffusers.max_num_conditional_frames
    if most >= frames:
        raise ValueError(
            f"policy.diffusers.max_num_conditional_frames ({most}) must be below the frames of "
            f"a sample ({frames}): at least one frame is generated"
        )
    return most


def _folder(cfg: Config) -> Path:
    """The local folder of a model named by a path or a Hub id (fetched into the cache)."""
    name = cfg.policy.model_name_or_path
    folder = Path(name)
    if not folder.is_dir() and is_hub_id(name):
        folder = _snapshot(name, revision=cfg.policy.model_revision, text=needs_text_encoder(cfg))
    return folder


def _check_latent(
    policy: PolicyConfig, vae_class: str | None, vae_config: dict[str, Any] | None
) -> None:
    """Refuse a frame shape the model's VAE cannot encode, and `compile_encode` without a
    VAE."""
    d = policy.diffusers
    if vae_class is None or vae_config is None:
        if d.tokenizer.compile_encode:
            raise ValueError(
                f"policy.diffusers.tokenizer.compile_encode = true: {policy.model_name_or_path}"
                " runs in pixel space: it has no VAE to compile"
            )
        return
    height, width = d.inference_size
    frames = d.inference_frames if d.is_video else 1
    check_vae_shape(vae_class, vae_config, frames=frames, height=height, width=width)


def check_flow_model(cfg: Config) -> None:
    """Raise, without building the model, what loading `cfg`'s flow model would (a Hub model
    is fetched into the cache here, once, for the job's processes)."""
    name = cfg.policy.model_name_or_path
    cp = cfg.policy.parallelism.cp_size
    folder = None if name.startswith("tiny:") else _folder(cfg)  # (a Hub model: fetched once)
    _check_prompt_dataset(cfg, folder)
    if name in DIFFUSERS_PRESETS:
        _shape(cfg.policy)
        vae = PRESET_VAES.get(name)
        vae_config = tiny_vae_config(vae) if vae is not None else None
        _check_latent(cfg.policy, vae, vae_config)
        _check_diffusers_cp(
            cfg.policy,
            DIFFUSERS_PRESETS[name],
            vae,
            vae_config,
            patch=1,
            latent_patch=TINY_LATENT_PATCH,
        )
        channels = 3 if vae is None or vae_config is None else vae_factors(vae, vae_config)[0]
        cosmos_mask = DIFFUSERS_PRESETS[name] == "CosmosTransformer3DModel" and vae is not None
        _check_diffusers_conditioning(
            cfg.policy,
            DIFFUSERS_PRESETS[name],
            channels + cosmos_mask,
            channels,
            name in TI2V_PRESETS,
        )
        return
    folder = folder or Path(name)
    if name not in FLOW_PRESETS and (kind := diffusers_class_of(folder)) is not None:
        found = check_diffusers_folder(name, folder)
        found_vae_config = found.vae_config() if found.vae else None
        _check_latent(cfg.policy, found.vae_class, found_vae_config)
        config = json.loads((kind[1] / "config.json").read_text())
        patch = config.get("patch_size") or 1
        _check_diffusers_cp(
            cfg.policy,
            kind[0],
            found.vae_class,
            found_vae_config,
            patch=patch[0] if isinstance(patch, list) else 1,
            latent_patch=int(config.get("latent_patch_size") or 1),
        )
        _check_diffusers_conditioning(
            cfg.policy,
            kind[0],
            config.get("in_channels"),
            config.get("out_channels"),
            found.expand_timesteps,
        )
        return
    _check_latent(cfg.policy, None, None)
    config = flow_model_config(cfg.policy)
    if config.frames % cp:
        raise ValueError(
            f"policy.parallelism.cp_size ({cp}) must divide the frames of a sample "
            f"({config.frames}, policy.diffusers.inference_frames): context parallelism splits "
            "a clip by whole frames"
        )


def _check_prompt_dataset(cfg: Config, folder: Path | None) -> None:
    """Refuse a prompt dataset (`flow.prompts`) where the data itself is needed, or where the
    model (in `folder`; None for a preset) has no text encoder nebula-rl runs."""
    datasets = _unembedded(cfg)
    if not datasets:
        return
    name = cfg.policy.model_name_or_path
    kind = DIFFUSERS_PRESETS.get(name) or (folder and (diffusers_class_of(folder) or ("",))[0])
    cosmos3 = kind == COSMOS3_CLASS  # (it reads every caption's tokens: no stored embeddings)
    if cfg.validation.enable and len(datasets) == 1 and not cosmos3:  # (one carries embeddings)
        other = "validation.dataset" if datasets[0][0].startswith("train") else "train dataset"
        raise ValueError(
            f"{datasets[0][0]} has captions the pipeline's text encoder embeds, and the "
            f"{other} carries its own embeddings: the model would see text from two encoders; "
            "give both kinds alike"
        )
    d = cfg.policy.diffusers
    p = cfg.train.train_policy
    for key, captions_only in datasets:
        why = ""
        if captions_only and isinstance(p, SftConfig) and not key.startswith("valid"):
            why = "world-model SFT trains on clips"  # (it validates on captions by sampling)
        elif captions_only and isinstance(p, GrpoConfig) and p.data_beta > 0:
            why = f"DDRL's data term (data_beta = {p.data_beta}) trains on clips"
        elif captions_only and d.max_num_conditional_frames:
            why = (
                f"conditioning frames (max_num_conditional_frames = {d.max_num_conditional_frames})"
            )
            why += " come from clips"
        if why:
            raise ValueError(
                f"{key}: a prompt dataset has captions only, and {why}: name a clip folder (the "
                "local layout, or cosmos-rl's diffusers layout as dataset.local_dir)"
            )
    if cosmos3:  # (its pipeline's tokenizer is its text encoder)
        return
    pipeline = None if folder is None else text_pipeline(folder)
    if pipeline not in TEXT_PIPELINES:
        raise ValueError(
            f"{KEY} = {name!r}: a prompt dataset's captions are embedded by the model's pipeline "
            f"text encoder: name a diffusers pipeline ({', '.join(TEXT_PIPELINES)}) whose "
            "model_index.json names text_encoder and tokenizer"
            + (f" (this one is {pipeline})" if pipeline else "")
        )


def _check_diffusers_conditioning(
    policy: PolicyConfig,
    class_name: str,
    channels_in: Any,
    channels_out: Any,
    expand_timesteps: bool,
) -> None:
    """Refuse conditioning frames for a diffusers transformer that cannot be told which frames
    are given: Cosmos-Predict2.5's latent-space transformer has a condition-mask input
    channel, a Wan transformer whose pipeline sets `expand_timesteps` (Wan 2.2 TI2V) takes
    per-token timesteps; others have neither."""
    most = policy.diffusers.max_num_conditional_frames
    mask = (
        class_name == "CosmosTransformer3DModel"
        and channels_out is not None
        and channels_in == channels_out + 1
    )
    ti2v = class_name == "WanTransformer3DModel" and expand_timesteps
    if most and not (mask or ti2v or class_name == COSMOS3_CLASS):  # (Cosmos 3: clean tokens)
        raise ValueError(
            f"policy.diffusers.max_num_conditional_frames = {most}: a {class_name} with "
            f"{channels_in} input channels has no condition-mask channel to mark given frames, "
            "nor per-token timesteps (Cosmos-Predict2.5's latent-space transformer, Wan 2.2 "
            "TI2V's with its pipeline's expand_timesteps, Cosmos 3's and the built-in DiT take "
            "them)"
        )


def _check_diffusers_cp(
    policy: PolicyConfig,
    class_name: str,
    vae: str | None,
    vae_config: dict[str, Any] | None,
    *,
    patch: int,
    latent_patch: int,
) -> None:
    """Refuse a `cp_size` that cannot split the clips of a diffusers transformer by whole
    frames: an image model, or frames (after the VAE and the patch embedding) it does not
    divide; Cosmos 3's generator, whose positions are per token, by equal shares of its latent
    patches (`latent_patch` x `latent_patch` latent pixels each)."""
    cp = policy.parallelism.cp_size
    if cp == 1:
        return
    if class_name == COSMOS3_CLASS and vae is not None and vae_config is not None:
        d = policy.diffusers
        _, spatial, temporal = vae_factors(vae, vae_config)
        height, width = d.inference_size
        frames = 1 + (d.inference_frames - 1) // temporal
        patches = frames * (height // spatial // latent_patch) * (width // spatial // latent_patch)
        if patches % cp:
            raise ValueError(
                f"policy.parallelism.cp_size ({cp}) must divide the {patches} latent patches of "
                f"a sample (policy.diffusers.inference_frames = {d.inference_frames}, "
                f"inference_size = {list(d.inference_size)}): context parallelism gives each "
                "rank an equal share of them"
            )
        return
    if class_name not in CP_CLASSES:
        why = " (it makes images)" if class_name in IMAGE_CLASSES else ""
        raise ValueError(
            f"policy.parallelism.cp_size = {cp}: context parallelism splits clips by frames, of "
            f"{', '.join(CP_CLASSES)} and the built-in DiT; not of a {class_name}{why}"
        )
    d = policy.diffusers
    frames = d.inference_frames if d.is_video else 1
    if vae is not None and vae_config is not None:
        frames = 1 + (frames - 1) // vae_factors(vae, vae_config)[2]
    frames //= patch
    if frames % cp:
        raise ValueError(
            f"policy.parallelism.cp_size ({cp}) must divide the frames of a sample ({frames} "
            f"after the VAE and the {class_name}'s patch embedding, of "
            f"policy.diffusers.inference_frames = {d.inference_frames}): context parallelism "
            "splits a clip by whole frames"
        )


def load_flow_model(cfg: Config, *, seed: int = 0) -> nn.Module:
    """The flow model of `cfg`: a preset at random init (seeded), an exported folder, or a
    diffusers transformer (local or from the Hub); with `policy.lora`, its adapter injected
    (seeded: every process of a job builds the same)."""
    model = _base_model(cfg, seed=seed)
    compute = resolve_dtype(cfg.train.param_dtype)
    if compute not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"train.param_dtype = {cfg.train.param_dtype!r}: a float dtype")
    model.compute_dtype = compute  # (mixed precision: autocast in the forward)
    if (vae := flow_vae(model)) is not None:
        vae.offload = cfg.policy.diffusers.offload
    if cfg.policy.lora is not None:
        torch.manual_seed(seed)
        apply_lora(model, cfg.policy.lora, trainer_type=cfg.train.train_policy.trainer_type)
    return model


def _base_model(cfg: Config, *, seed: int) -> TinyDiT | DiffusersFlowModel:
    name = cfg.policy.model_name_or_path
    compile_encode = cfg.policy.diffusers.tokenizer.compile_encode
    if name in DIFFUSERS_PRESETS:
        frames, size = _shape(cfg.policy)
        vae = PRESET_VAES.get(name)
        _check_latent(cfg.policy, vae, tiny_vae_config(vae) if vae is not None else None)
        return tiny_diffusers_flow_model(
            name, frames=frames, size=size, text_dim=TOY_TEXT_DIM, seed=seed,
            compile_encode=compile_encode,
        )  # fmt: skip
    folder = Path(name) if name in FLOW_PRESETS else _folder(cfg)
    if name not in FLOW_PRESETS and diffusers_class_of(folder) is not None:
        found = check_diffusers_folder(name, folder)
        _check_latent(cfg.policy, found.vae_class, found.vae_config() if found.vae else None)
        diffusers_model = load_diffusers_flow_model(name, folder, compile_encode=compile_encode)
        if diffusers_model.kind == COSMOS3_CLASS:  # (it reads its captions' tokens)
            assert diffusers_model.vae is not None
            d = cfg.policy.diffusers
            diffusers_model.text_encoder = Cosmos3Prompts.from_folder(
                name, found.transformer.parent, diffusers_model.transformer,
                diffusers_model.vae.module, frames=d.inference_frames if d.is_video else 1,
                height=d.inference_size[0], width=d.inference_size[1],
            )  # fmt: skip
        elif needs_text_encoder(cfg):  # (captions without embeddings: the pipeline embeds them)
            diffusers_model.text_encoder = PipelineTextEncoder(
                folder,
                max_length=cfg.policy.diffusers.max_prompt_length,
                dtype=resolve_dtype(cfg.train.param_dtype),
                offload=cfg.policy.diffusers.offload,
            )
        return diffusers_model
    _check_latent(cfg.policy, None, None)
    config = flow_model_config(cfg.policy)
    torch.manual_seed(seed)
    model = TinyDiT(config)
    if name not in FLOW_PRESETS:
        state = load_file(str(Path(name) / "model.safetensors"))
        if config.conditioning and "cond_embed" not in state:  # (gained: see flow_model_config)
            state["cond_embed"] = model.cond_embed.detach().clone()
        model.load_state_dict(state)
    return model


def pipeline_file(path: str, *, text: bool = False) -> bool:
    """Whether a diffusers repo's file is one nebula-rl needs: the pipeline index, a root
    transformer's config and weights, or a file directly in `transformer/` or `vae/`; with
    `text` (captions to embed), also in `text_encoder*/` and `tokenizer*/` (without, the
    datasets' precomputed embeddings replace them)."""
    top, _, rest = path.partition("/")
    if not rest:
        return path in ("model_index.json", "config.json") or path.endswith(".safetensors")
    texts = ("text_encoder", "tokenizer")  # (SD3's also text_encoder_2, _3, tokenizer_2, _3)
    always = ("transformer", "vae", "text_tokenizer", "scheduler")  # (Cosmos 3: its tokenizer)
    return (top in always or (text and top.startswith(texts))) and "/" not in rest


def _unembedded(cfg: Config) -> list[tuple[str, bool]]:
    """(config key, whether it holds captions only) of each of `cfg`'s datasets without text
    embeddings: a prompt dataset (`flow.prompts`) or a diffusers folder of captions beside
    their clips (`dataset.local_dir`)."""
    out = []
    train = cfg.train.train_policy.dataset
    if train.local_dir:
        out.append(("train.train_policy.dataset.local_dir", False))
    elif train.name and is_prompt_dataset(train.name):
        out.append(("train.train_policy.dataset.name", True))
    val = cfg.validation.dataset
    if cfg.validation.enable and (name := val.name or val.local_dir) and is_prompt_dataset(name):
        out.append((f"validation.dataset.{'name' if val.name else 'local_dir'}", True))
    return out


def needs_text_encoder(cfg: Config) -> bool:
    """Whether some of `cfg`'s data has captions without embeddings, which the model's pipeline
    text encoder embeds (`flow.text_encoder`)."""
    return bool(_unembedded(cfg))


def _snapshot(repo_id: str, *, revision: str | None, text: bool = False) -> Path:
    """A diffusers repo's pipeline index, transformer and VAE (with `text`, its text encoder and
    tokenizer), fetched into the Hugging Face cache."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        files = HfApi().list_repo_files(repo_id, revision=revision)
        if "model_index.json" in files:  # (a pipeline: not the root's weights, e.g. Cosmos 3's
            files = [f for f in files if "/" in f or f == "model_index.json"]  # reasoner's)
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=[f for f in files if pipeline_file(f, text=text)],
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError) as err:
        raise ValueError(
            f"{KEY}: {repo_id!r} (revision {revision or 'main'}) cannot be fetched from the "
            f"Hugging Face Hub: {str(err).splitlines()[0]}"
        ) from err


def save_flow_model(model: nn.Module, folder: Path | str) -> Path:
    """Export `model` to `folder`: config.json + model.safetensors for the built-in DiT, a
    diffusers transformer folder for a diffusers model (a pipeline folder with its VAE in latent
    space); a LoRA-adapted model exports its merged weights so, and its adapter under
    `adapter/`. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if lora_adapter_state(model) is not None:  # the merged weights, and the adapter alone
        save_flow_model(merged_copy(model), folder)
        save_adapter(model, folder / "adapter")
        return folder
    if isinstance(model, DiffusersFlowModel):
        save_diffusers_flow_model(model, folder)
        return folder
    assert isinstance(model, TinyDiT)
    config = {"model_type": FLOW_MODEL_TYPE, **model.config.to_dict()}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder
