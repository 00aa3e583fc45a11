"""diffusers transformers as flow models: `CosmosTransformer3DModel` (Cosmos-Predict2.5),
`WanTransformer3DModel` (Wan 2.x), `SD3Transformer2DModel` (Stable Diffusion 3),
`SanaTransformer2DModel` (Sana 1.x) and `SanaVideoTransformer3DModel` (SANA-Video), each behind
the call every flow model of nebula-rl answers, `model(x, sigma, text, text_mask) -> velocity`;
also Cosmos 3's `Cosmos3OmniTransformer`, whose text is its prompt's token ids
(:mod:`nebula_rl.flow.cosmos3` packs and calls it).

The five predict the rectified-flow velocity `noise - x0`, as the built-in DiT does; they differ
in how they take the noise level and the text:

- Cosmos-Predict2.5 takes sigma itself (in [0, 1]) as its timestep; Wan, SD3 and Sana take
  `1000 sigma` (their schedulers' timesteps; Sana's times its `timestep_scale`);
- Sana and SANA-Video also take the text mask (`encoder_attention_mask`); Sana makes images
  only;
- the text embeddings go in as `encoder_hidden_states`, zeroed past each caption's tokens (the
  pipelines' zero padding; a row without text, guidance's unconditional branch, is all zeros);
- SD3 also takes a pooled text vector: its pipeline's (the first row of the embeddings, where
  its text encoder embeds the captions: `flow.text_encoder`), else the mean of the caption's
  token embeddings (precomputed datasets carry no pooled vector); it makes images only (one
  frame).

A transformer with `in_channels = 3` runs in pixel space. Any other runs in the latent space of
the VAE its pipeline folder holds (`model_index.json` naming `transformer` and `vae`; the VAE is
loaded from `vae/`, frozen: `nebula_rl.flow.vae`): its `out_channels` are the VAE's latent
channels, and its `in_channels` too, or one more for Cosmos-Predict2.5's condition-mask channel
(all zeros: text-to-world, no frame is given). A latent-space transformer without its VAE, a
VAE nebula-rl does not run, or channels that do not match are refused by name before the job
starts. diffusers is an optional extra (`pip install nebula-rl[wfm]`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nebula_rl.flow.context_parallel import split_diffusers_transformer
from nebula_rl.flow.cosmos3 import (
    COSMOS3_CLASS,
    COSMOS3_PIPELINE,
    Cosmos3Prompts,
    cosmos3_velocity,
    tiny_cosmos3_transformer,
)
from nebula_rl.flow.dit import autocast
from nebula_rl.flow.tiny_vae import TINY_VAE_SEED, load_tiny_vae, tiny_vae_config
from nebula_rl.flow.vae import FlowVAE, vae_factors

__all__ = [
    "DIFFUSERS_CLASSES",
    "DIFFUSERS_PRESETS",
    "IMAGE_CLASSES",
    "PRESET_VAES",
    "TI2V_PRESETS",
    "TRAINED_VAE_PRESETS",
    "DiffusersFlowModel",
    "DiffusersFolder",
    "check_diffusers_folder",
    "diffusers_class_of",
    "load_diffusers_flow_model",
    "save_diffusers_flow_model",
    "tiny_diffusers_flow_model",
    "tiny_vae_config",
]

DIFFUSERS_CLASSES = (
    "CosmosTransformer3DModel",
    "WanTransformer3DModel",
    "SD3Transformer2DModel",
    "SanaTransformer2DModel",
    "SanaVideoTransformer3DModel",
    COSMOS3_CLASS,
)
"""The diffusers transformer classes nebula-rl trains."""

IMAGE_CLASSES = ("SD3Transformer2DModel", "SanaTransformer2DModel")
"""The classes that make images (one frame)."""

DIFFUSERS_PRESETS = {
    "tiny:cosmos_transformer3d": "CosmosTransformer3DModel",
    "tiny:wan_transformer3d": "WanTransformer3DModel",
    "tiny:sd3_transformer2d": "SD3Transformer2DModel",
    "tiny:sana_transformer2d": "SanaTransformer2DModel",
    "tiny:sana_video_transformer3d": "SanaVideoTransformer3DModel",
    "tiny:cosmos_transformer3d_latent": "CosmosTransformer3DModel",
    "tiny:wan_transformer3d_latent": "WanTransformer3DModel",
    "tiny:sd3_transformer2d_latent": "SD3Transformer2DModel",
    "tiny:sana_transformer2d_latent": "SanaTransformer2DModel",
    "tiny:sana_video_transformer3d_latent": "SanaVideoTransformer3DModel",
    "tiny:cosmos3_omni_generator": COSMOS3_CLASS,
}
"""Random-init miniatures of each class (two blocks, width 64) for CPU tests and demos; the
`_latent` ones with a miniature VAE (:data:`PRESET_VAES`)."""

PRESET_VAES = {
    "tiny:cosmos_transformer3d_latent": "AutoencoderKLWan",
    "tiny:wan_transformer3d_latent": "AutoencoderKLWan",
    "tiny:sd3_transformer2d_latent": "AutoencoderKL",
    "tiny:sana_transformer2d_latent": "AutoencoderDC",
    "tiny:sana_video_transformer3d_latent": "AutoencoderKLWan",
    "tiny:cosmos3_omni_generator": "AutoencoderKLWan",
}
"""The latent-space presets' VAE classes (:func:`tiny_vae_config`: 4 latent channels, frames
halved in size, Wan's also in time; a fixed random init, or trained:
:data:`TRAINED_VAE_PRESETS`)."""

PIPELINES = {
    "CosmosTransformer3DModel": "Cosmos2_5_PredictBasePipeline",
    "WanTransformer3DModel": "WanPipeline",
    "SD3Transformer2DModel": "StableDiffusion3Pipeline",
    "SanaTransformer2DModel": "SanaPipeline",
    "SanaVideoTransformer3DModel": "SanaVideoPipeline",
    COSMOS3_CLASS: COSMOS3_PIPELINE,
}
"""The pipeline class an export's `model_index.json` names, by transformer class."""

TRAINED_VAE_PRESETS = {"tiny:cosmos3_omni_generator"}
"""Presets whose miniature VAE is the trained one (`flow.tiny_vae`: same architecture, decodes
what the transformer makes); the others' is at a fixed random init."""

TI2V_PRESETS = {"tiny:wan_transformer3d_latent"}
"""Presets that take conditioning frames by per-token timesteps, as Wan 2.2 TI2V does (its
pipeline's `expand_timesteps`)."""

_THOUSAND = {
    "WanTransformer3DModel",
    "SD3Transformer2DModel",
    "SanaTransformer2DModel",
    "SanaVideoTransformer3DModel",
}
"""Classes whose timestep is 1000 sigma (Cosmos 3's too, given in `flow.cosmos3`)."""

KEY = "policy.model_name_or_path"


def _diffusers() -> Any:
    try:
        import diffusers
    except ImportError as err:
        raise ValueError(
            f"{KEY}: diffusers models need the diffusers package: pip install 'nebula-rl[wfm]'"
        ) from err
    return diffusers


class DiffusersFlowModel(nn.Module):
    """A diffusers transformer behind `forward(x [B, C, T, H, W], sigma [B], text [B, L, D],
    text_mask [B, L]) -> velocity [B, C, T, H, W]`; `x` is pixels, or the latents of `vae`."""

    def __init__(
        self, transformer: nn.Module, *, vae: FlowVAE | None = None, expand_timesteps: bool = False
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.kind = type(transformer).__name__
        if self.kind not in DIFFUSERS_CLASSES:
            raise ValueError(f"{KEY}: {self.kind} is not one of {DIFFUSERS_CLASSES}")
        self.vae = vae
        """The frozen VAE of a latent-space model (a plain attribute: not a submodule)."""
        config = self.config
        self.condition_channel = (
            self.kind == "CosmosTransformer3DModel"
            and config.in_channels == config.out_channels + 1
        )
        """Cosmos-Predict2.5's condition-mask channel, given as zeros (no conditioning frame)."""
        self.expand_timesteps = expand_timesteps and self.kind == "WanTransformer3DModel"
        """Wan 2.2 TI2V's per-token timesteps (its pipeline's `expand_timesteps`): a given
        frame's tokens go in at timestep 0, the others at the sample's."""

    @property
    def takes_conditioning(self) -> bool:
        """Whether the transformer can be told which frames are given (a condition-mask channel
        or per-token timesteps)."""
        return self.condition_channel or self.expand_timesteps or self.kind == COSMOS3_CLASS

    @property
    def config(self) -> Any:
        """The transformer's diffusers config."""
        return self.transformer.config

    compute_dtype: torch.dtype = torch.float32
    """The dtype the forward computes in (`train.param_dtype`; autocast below float32)."""

    cp_group: dist.ProcessGroup | None = None
    """The context-parallel group the frames are split over (None: not split)."""

    text_encoder: Any = None
    """The pipeline's text encoder for a prompt dataset (`flow.text_encoder`; a plain
    attribute, shared by copies of the model)."""

    def guidance_scale(self, scale: float) -> float:
        """`policy.diffusers.sample.guidance_scale` as the scale of `v_u + s (v_c - v_u)`
        (:func:`~nebula_rl.flow.sampler.guided_velocity`): the same, except for Cosmos-Predict2.5,
        whose pipelines guide as `v_c + g (v_c - v_u)` when g > 1 (s = 1 + g) and not at all
        otherwise."""
        if self.kind != "CosmosTransformer3DModel":
            return scale
        return 1.0 + scale if scale > 1.0 else 1.0

    def context_parallel(self, group: dist.ProcessGroup) -> None:
        """Split every sample's frames over `group`'s ranks (`flow.context_parallel`: Cosmos and
        Wan transformers; Cosmos 3's generator by its latent patches); each rank of the group
        must be given the same inputs."""
        split_diffusers_transformer(self.transformer, group)
        self.cp_group = group

    def forward(
        self,
        x: Tensor,
        sigma: Tensor,
        text: Tensor,
        text_mask: Tensor,
        condition: Tensor | None = None,
    ) -> Tensor:
        """Velocity of `x`; `condition` [B, T] (1: a given conditioning frame) goes to
        Cosmos-Predict2.5's condition-mask channel, or sets a Wan 2.2 TI2V transformer's
        timestep to 0 on the given frames' tokens (as its pipeline does)."""
        with autocast(self.compute_dtype, x):
            return self._velocity(x, sigma, text, text_mask, condition)

    def _velocity(
        self, x: Tensor, sigma: Tensor, text: Tensor, text_mask: Tensor, condition: Tensor | None
    ) -> Tensor:
        if condition is not None and not self.takes_conditioning:
            raise ValueError(
                f"{self.kind} without a condition-mask input channel or per-token timesteps "
                "takes no conditioning frames (Cosmos-Predict2.5's latent-space transformer and "
                "Wan 2.2 TI2V's do)"
            )
        if self.kind == COSMOS3_CLASS:  # (prompt token ids, one packed sequence a sample)
            assert isinstance(self.text_encoder, Cosmos3Prompts)
            velocity = cosmos3_velocity(
                self.transformer, self.text_encoder, x, sigma, text, condition
            )
            return velocity.to(x.dtype)
        dtype = next(self.transformer.parameters()).dtype
        text = (text * text_mask.unsqueeze(-1).to(text.dtype)).to(dtype)
        t = (sigma * 1000 if self.kind in _THOUSAND else sigma).to(dtype)
        hidden = x.to(dtype)
        image = self.kind in IMAGE_CLASSES
        if image:  # (one frame: [B, C, H, W] in, and out)
            if x.shape[2] != 1:
                raise ValueError(f"{self.kind} makes images: got {x.shape[2]} frames")
            hidden = hidden[:, :, 0]
        if self.kind in ("SanaTransformer2DModel", "SanaVideoTransformer3DModel"):
            out = self.transformer(
                hidden, encoder_hidden_states=text, encoder_attention_mask=text_mask,
                timestep=t * getattr(self.config, "timestep_scale", 1.0), return_dict=False,
            )[0]  # fmt: skip
        elif self.kind == "SD3Transformer2DModel":
            if getattr(self.text_encoder, "pooled_row", False):  # (its pipeline's pooled vector)
                pooled = text[:, 0, : self.config.pooled_projection_dim]
                text = text[:, 1:]
            else:  # (precomputed embeddings carry none: the caption's tokens pooled)
                counts = text_mask.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)
                pooled = text.sum(dim=1) / counts
            out = self.transformer(
                hidden, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                return_dict=False,
            )[0]  # fmt: skip
        elif self.kind == "CosmosTransformer3DModel":
            padding = None
            if self.config.concat_padding_mask:  # (no padded pixels)
                padding = x.new_zeros(1, x.shape[-2], x.shape[-1], dtype=dtype)
            mask = None
            if self.condition_channel:  # (1 on the given frames; zeros without any)
                mask = hidden.new_zeros(x.shape[0], 1, *x.shape[2:])
                if condition is not None:
                    mask = mask + condition.to(dtype)[:, None, :, None, None]
            out = self.transformer(
                hidden, t, text, condition_mask=mask, padding_mask=padding,
                return_dict=False,
            )[0]  # fmt: skip
        else:
            if condition is not None:  # (Wan 2.2 TI2V: [B, tokens], 0 on the given frames)
                p_t, p_h, p_w = self.config.patch_size
                tokens = (x.shape[-2] // p_h) * (x.shape[-1] // p_w)
                keep = (1 - condition.to(dtype))[:, ::p_t]
                t = (t[:, None] * keep).repeat_interleave(tokens, dim=1)
            out = self.transformer(hidden, t, text, return_dict=False)[0]
        return (out.unsqueeze(2) if image else out).to(x.dtype)


def diffusers_class_of(folder: Path) -> tuple[str, Path] | None:
    """(class name, transformer folder) of a diffusers pipeline folder (`model_index.json` and
    `transformer/`) or transformer folder (`config.json` with `_class_name`); None otherwise."""
    index = folder / "model_index.json"
    if index.is_file():
        entry = json.loads(index.read_text()).get("transformer")
        if isinstance(entry, list) and len(entry) == 2:
            return str(entry[1]), folder / "transformer"
    config = folder / "config.json"
    if config.is_file():
        name = json.loads(config.read_text()).get("_class_name")
        if isinstance(name, str) and name.endswith("Model") and "Transformer" in name:
            return name, folder
    return None


@dataclass(frozen=True, slots=True)
class DiffusersFolder:
    """What a diffusers folder holds for nebula-rl: its transformer and, for a latent-space
    model, its VAE."""

    transformer_class: str
    transformer: Path
    vae_class: str | None = None
    vae: Path | None = None
    """`vae/` of the pipeline folder (None: a pixel-space model)."""
    expand_timesteps: bool = False
    """The pipeline's `expand_timesteps` (Wan 2.2 TI2V: per-token timesteps)."""

    def vae_config(self) -> dict[str, Any]:
        """The VAE's diffusers config."""
        assert self.vae is not None
        return json.loads((self.vae / "config.json").read_text())  # type: ignore[no-any-return]


def _check_channels(name: str, class_name: str, config: dict[str, Any], latent: int) -> None:
    """Refuse a transformer whose channels are not `latent` (Cosmos: in, or one more)."""
    channels_in, channels_out = config.get("in_channels"), config.get("out_channels")
    if class_name == COSMOS3_CLASS:  # (its latent channels, patchified inside)
        channels_in = channels_out = config.get("latent_channel")
    allowed = {latent, latent + 1} if class_name == "CosmosTransformer3DModel" else {latent}
    if channels_out not in (None, latent) or channels_in not in allowed:
        raise ValueError(
            f"{KEY}: {name}: the {class_name} takes {channels_in} channels and gives "
            f"{channels_out}, its VAE's latents have {latent}; nebula-rl runs text-to-world "
            "models (in_channels = the latent channels, or one more for Cosmos-Predict2.5's "
            "condition mask; image-to-video conditioning channels are not built)"
        )


def check_diffusers_folder(name: str, folder: Path) -> DiffusersFolder:
    """What the diffusers folder `folder` (`name`, as the user wrote it) holds for nebula-rl,
    read from its configs without loading weights; a ValueError naming the key if nebula-rl
    cannot train it."""
    found = diffusers_class_of(folder)
    if found is None:
        raise ValueError(f"{KEY}: {name} is not a diffusers pipeline or transformer folder")
    class_name, where = found
    if class_name not in DIFFUSERS_CLASSES:
        raise ValueError(
            f"{KEY}: {name} holds a {class_name}; nebula-rl trains {', '.join(DIFFUSERS_CLASSES)}"
        )
    config = json.loads((where / "config.json").read_text())
    if config.get("guidance_embeds"):
        raise ValueError(
            f"{KEY}: {name}: a {class_name} with guidance_embeds (a guidance-distilled model, "
            "Sana-Sprint's) takes the guidance scale as an input, which nebula-rl does not give"
        )
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    second = index.get("transformer_2")
    if isinstance(second, list) and second[0] is not None:
        raise ValueError(
            f"{KEY}: {name} is a two-expert pipeline (transformer_2, switched at boundary_ratio "
            f"{index.get('boundary_ratio')}: Wan 2.2 A14B); nebula-rl trains one transformer"
        )
    expand = bool(index.get("expand_timesteps", False))
    if config.get("in_channels") == 3:
        return DiffusersFolder(class_name, where, expand_timesteps=expand)
    entry = index.get("vae")
    vae = folder / "vae"
    if not (isinstance(entry, list) and len(entry) == 2 and (vae / "config.json").is_file()):
        raise ValueError(
            f"{KEY}: {name} is a latent-space {class_name} (in_channels = "
            f"{config.get('in_channels')}) without its VAE: name the pipeline folder whose "
            "model_index.json names a vae and holds vae/ (a transformer folder alone has none)"
        )
    found_vae = DiffusersFolder(class_name, where, str(entry[1]), vae, expand)
    latent, _, _ = vae_factors(str(entry[1]), found_vae.vae_config())
    _check_channels(name, class_name, config, latent)
    return found_vae


def load_diffusers_flow_model(
    name: str, folder: Path, *, compile_encode: bool = False
) -> DiffusersFlowModel:
    """The transformer of the diffusers folder `folder` (`name`, as the user wrote it), with
    its VAE for a latent-space model (`compile_encode`: its encoder call compiled)."""
    found = check_diffusers_folder(name, folder)
    diffusers = _diffusers()
    transformer = getattr(diffusers, found.transformer_class).from_pretrained(
        str(found.transformer)
    )
    vae = None
    if found.vae is not None:
        module = getattr(diffusers, str(found.vae_class)).from_pretrained(
            str(found.vae), torch_dtype=torch.float32
        )
        vae = FlowVAE(module, compile_encode=compile_encode)
    return DiffusersFlowModel(transformer, vae=vae, expand_timesteps=found.expand_timesteps)


def save_diffusers_flow_model(model: DiffusersFlowModel, folder: Path) -> None:
    """Export `model` as diffusers loads it: a transformer folder in pixel space; in latent
    space a pipeline folder, `transformer/` and the VAE as it was loaded in `vae/` (and the
    text encoder and tokenizer a prompt dataset used), with a `model_index.json` naming them
    (loadable as `policy.model_name_or_path`)."""
    if model.vae is None and model.text_encoder is None:
        model.transformer.save_pretrained(str(folder))  # type: ignore[operator]
        return
    model.transformer.save_pretrained(str(folder / "transformer"))  # type: ignore[operator]
    index: dict[str, Any] = {
        "_class_name": PIPELINES[model.kind],
        "_diffusers_version": _diffusers().__version__,
        "transformer": ["diffusers", model.kind],
    }
    if model.vae is not None:
        model.vae.module.save_pretrained(str(folder / "vae"))  # type: ignore[operator]
        index["vae"] = ["diffusers", model.vae.kind]
    if model.expand_timesteps:
        index["expand_timesteps"] = True
    if isinstance(model.text_encoder, Cosmos3Prompts):  # (its tokenizer and scheduler)
        index.update(model.text_encoder.save(folder))
    elif model.text_encoder is not None:  # (a prompt dataset's: the export embeds as it was)
        source = json.loads((model.text_encoder.folder / "model_index.json").read_text())
        for part, entry in source.items():  # (SD3: text_encoder, _2, _3 and their tokenizers)
            if part.startswith(("text_encoder", "tokenizer")) and isinstance(entry, list):
                _link_tree(model.text_encoder.folder / part, folder / part)
                index[part] = entry
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _link_tree(source: Path, target: Path) -> None:
    """Copy the folder `source` to `target` by hard links where the filesystem allows (a text
    encoder's weights are not rewritten per export), else by copies."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link, dirs_exist_ok=True)


def tiny_diffusers_flow_model(
    preset: str,
    *,
    frames: int,
    size: int,
    text_dim: int,
    seed: int = 0,
    compile_encode: bool = False,
) -> DiffusersFlowModel:
    """The random-init miniature `preset` of :data:`DIFFUSERS_PRESETS` for `frames` frames of
    `size` x `size` pixels and text embeddings `text_dim` wide (`compile_encode`: a latent
    preset's VAE encoder call compiled)."""
    diffusers = _diffusers()
    class_name = DIFFUSERS_PRESETS[preset]
    if class_name in IMAGE_CLASSES and frames != 1:
        raise ValueError(f"{KEY} = {preset!r} makes images: set policy.diffusers.is_video = false")
    vae = None
    channels = 3
    pixel_frames, pixel_size = frames, size
    if preset in PRESET_VAES:
        torch.manual_seed(TINY_VAE_SEED)
        vae_class = PRESET_VAES[preset]
        if preset in TRAINED_VAE_PRESETS:
            module = load_tiny_vae()
        else:
            module = getattr(diffusers, vae_class)(**tiny_vae_config(vae_class))
        vae = FlowVAE(module, compile_encode=compile_encode)
        channels, frames, size, _ = vae.latent_shape((3, frames, size, size))
    torch.manual_seed(seed)
    if class_name == COSMOS3_CLASS:  # (its prompt tokens: the vision-language presets' tokenizer)
        from nebula_rl.models import build_char_tokenizer

        assert vae is not None
        tokenizer = build_char_tokenizer()
        cosmos3 = DiffusersFlowModel(
            tiny_cosmos3_transformer(channels, (len(tokenizer) + 63) // 64 * 64), vae=vae
        )
        cosmos3.text_encoder = Cosmos3Prompts(
            cosmos3.transformer, tokenizer, vae.module, frames=pixel_frames, height=pixel_size,
            width=pixel_size,
        )  # fmt: skip
        return cosmos3
    channels_in = (
        channels + 1 if vae is not None and class_name == "CosmosTransformer3DModel" else channels
    )
    transformer = _tiny_transformer(
        class_name, channels_in, channels, frames=frames, size=size, text_dim=text_dim
    )
    return DiffusersFlowModel(transformer, vae=vae, expand_timesteps=preset in TI2V_PRESETS)


def _tiny_transformer(
    class_name: str, channels_in: int, channels_out: int, *, frames: int, size: int, text_dim: int
) -> nn.Module:
    """A two-block `class_name` of width 64 for `frames` frames of `size` x `size` (latents or
    pixels) with `channels_in` / `channels_out` channels."""
    diffusers = _diffusers()
    heads, head_dim = 2, 32
    if class_name == "CosmosTransformer3DModel":
        return diffusers.CosmosTransformer3DModel(  # type: ignore[no-any-return]
            in_channels=channels_in, out_channels=channels_out, num_attention_heads=heads,
            attention_head_dim=head_dim, num_layers=2, text_embed_dim=text_dim, adaln_lora_dim=16,
            max_size=(max(frames, 2), size, size), patch_size=(1, 2, 2),
            concat_padding_mask=False, encoder_hidden_states_channels=text_dim,
        )  # fmt: skip
    if class_name == "WanTransformer3DModel":
        return diffusers.WanTransformer3DModel(  # type: ignore[no-any-return]
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
            in_channels=channels_in, out_channels=channels_out, text_dim=text_dim, freq_dim=32,
            ffn_dim=128, num_layers=2, rope_max_seq_len=64,
        )  # fmt: skip
    if class_name in ("SanaTransformer2DModel", "SanaVideoTransformer3DModel"):
        video = class_name == "SanaVideoTransformer3DModel"
        shape = {"patch_size": (1, 2, 2), "rope_max_seq_len": 64} if video else {"patch_size": 1}
        return getattr(diffusers, class_name)(  # type: ignore[no-any-return]
            in_channels=channels_in, out_channels=channels_out, num_attention_heads=heads,
            attention_head_dim=head_dim, num_layers=2, num_cross_attention_heads=heads,
            cross_attention_head_dim=head_dim, cross_attention_dim=heads * head_dim,
            caption_channels=text_dim, sample_size=size, **shape,
        )  # fmt: skip
    return diffusers.SD3Transformer2DModel(  # type: ignore[no-any-return]
        sample_size=size, patch_size=2, in_channels=channels_in, out_channels=channels_out,
        num_layers=2, attention_head_dim=head_dim, num_attention_heads=heads,
        joint_attention_dim=text_dim, caption_projection_dim=heads * head_dim,
        pooled_projection_dim=text_dim, pos_embed_max_size=size,
    )  # fmt: skip
