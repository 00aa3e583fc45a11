"""Flow models by name: the built-in preset `tiny:dit`, or a folder nebula-rl exported
(`config.json` with `"model_type": "nebula_tiny_dit"` and `model.safetensors`).

A preset's frames and frame size come from the config (`policy.diffusers.inference_frames` when
`is_video`, else 1; `inference_size`); its widths are fixed (:data:`FLOW_PRESETS`). diffusers
models (`CosmosTransformer3DModel`, ...) are not loaded yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nebula_rl.config import Config
from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig

__all__ = [
    "FLOW_MODEL_TYPE",
    "FLOW_PRESETS",
    "flow_model_config",
    "load_flow_model",
    "save_flow_model",
]

FLOW_MODEL_TYPE = "nebula_tiny_dit"
FLOW_PRESETS: dict[str, dict[str, int]] = {
    "tiny:dit": {"patch": 4, "width": 64, "depth": 3, "heads": 4, "text_dim": 32},
}
"""Preset name -> the TinyDiT widths it fixes."""
KEY = "policy.model_name_or_path"


def _shape(cfg: Config) -> tuple[int, int]:
    """(frames, size) the config asks for."""
    d = cfg.policy.diffusers
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


def flow_model_config(cfg: Config) -> TinyDiTConfig:
    """The architecture `policy.model_name_or_path` names, checked against the config's shape."""
    name = cfg.policy.model_name_or_path
    frames, size = _shape(cfg)
    if name in FLOW_PRESETS:
        return TinyDiTConfig(frames=frames, size=size, **FLOW_PRESETS[name])
    path = Path(name) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{KEY}: {name!r} is neither a flow-model preset ({sorted(FLOW_PRESETS)}) nor a "
            "folder exported by nebula-rl (config.json); diffusers models are not supported yet"
        )
    data = json.loads(path.read_text())
    if data.pop("model_type", None) != FLOW_MODEL_TYPE:
        raise ValueError(f"{KEY}: {path} is not a nebula-rl flow model ({FLOW_MODEL_TYPE})")
    config = TinyDiTConfig(**data)
    if (config.frames, config.size) != (frames, size):
        raise ValueError(
            f"{KEY}: {name} makes {config.frames} frame(s) of {config.size} px; the config asks "
            f"for {frames} of {size} (policy.diffusers.inference_frames / inference_size)"
        )
    return config


def load_flow_model(cfg: Config, *, seed: int = 0) -> TinyDiT:
    """The flow model of `cfg`: a preset at random init (seeded), or an exported folder."""
    config = flow_model_config(cfg)
    torch.manual_seed(seed)
    model = TinyDiT(config)
    name = cfg.policy.model_name_or_path
    if name not in FLOW_PRESETS:
        model.load_state_dict(load_file(str(Path(name) / "model.safetensors")))
    return model


def save_flow_model(model: TinyDiT, folder: Path | str) -> Path:
    """Export `model` to `folder` (config.json + model.safetensors); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": FLOW_MODEL_TYPE, **model.config.to_dict()}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder
