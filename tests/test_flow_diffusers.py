"""diffusers transformers as flow models (`nebula_rl.flow.diffusers_models`): each class answers
the flow-model call, exports as a folder diffusers loads, loads from pipeline and transformer
folders, refuses a latent-space transformer without its VAE by name, and trains with FlowGRPO in
one process and with rollout replicas. Latent-space models: tests/test_flow_vae.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import CosmosTransformer3DModel

from flow_configs import tiny_flow_config, tiny_flow_policy
from nebula_rl.config import config_from_dict
from nebula_rl.flow.diffusers_models import (
    DIFFUSERS_PRESETS,
    IMAGE_CLASSES,
    PRESET_VAES,
    DiffusersFlowModel,
)
from nebula_rl.flow.models import check_flow_model, load_flow_model, save_flow_model

VIDEO_PRESETS = ["tiny:cosmos_transformer3d", "tiny:wan_transformer3d"]
PIXEL_PRESETS = sorted(set(DIFFUSERS_PRESETS) - set(PRESET_VAES))


def _cfg(tmp_path: Path, model: str, *, frames: int = 2) -> dict:
    """A small world-model FlowGRPO config (8 x 8 pixels) of `model`, as a dict."""
    return tiny_flow_config(
        tmp_path / "runs", tiny_flow_policy(model, frames=frames), timestamp="diffusers"
    )


def _inputs(frames: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, frames, 8, 8, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.1])
    text = torch.randn(3, 4, 32, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])  # the last: no text
    return x, sigma, text, mask


@pytest.mark.parametrize("preset", PIXEL_PRESETS)
def test_each_diffusers_class_answers_the_flow_model_call(tmp_path, preset):
    frames = 1 if DIFFUSERS_PRESETS[preset] in IMAGE_CLASSES else 2
    model = load_flow_model(config_from_dict(_cfg(tmp_path, preset, frames=frames)))
    assert isinstance(model, DiffusersFlowModel)
    x, sigma, text, mask = _inputs(frames)
    v = model(x, sigma, text, mask)
    assert v.shape == x.shape and torch.isfinite(v).all()
    # the text past each caption's tokens is not read: changing it changes nothing
    noisy = text.clone()
    noisy[mask == 0] = 100.0
    assert torch.allclose(model(x, sigma, noisy, mask), v, atol=1e-5)
    # the noise level is read (Cosmos: sigma; Wan, SD3, Sana: 1000 sigma)
    assert not torch.allclose(model(x, sigma.flip(0), text, mask), v)
    v.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("preset", ["tiny:sd3_transformer2d", "tiny:sana_transformer2d"])
def test_the_image_model_refuses_video(tmp_path, preset):
    with pytest.raises(ValueError, match=r"makes images: set policy\.diffusers\.is_video = false"):
        load_flow_model(config_from_dict(_cfg(tmp_path, preset, frames=2)))


@pytest.mark.parametrize("preset", VIDEO_PRESETS)
def test_an_export_is_a_diffusers_folder_and_loads_back(tmp_path, preset):
    cfg = _cfg(tmp_path, preset)
    model = load_flow_model(config_from_dict(cfg), seed=3)
    folder = save_flow_model(model, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert config["_class_name"] == DIFFUSERS_PRESETS[preset]
    back = load_flow_model(
        config_from_dict({**cfg, "policy": {**cfg["policy"], "model_name_or_path": str(folder)}})
    )
    x, sigma, text, mask = _inputs(2)
    assert torch.equal(back(x, sigma, text, mask), model(x, sigma, text, mask))


def test_a_pipeline_folder_loads_its_transformer_and_a_latent_model_needs_its_vae(tmp_path):
    cfg = _cfg(tmp_path, "tiny:cosmos_transformer3d")
    model = load_flow_model(config_from_dict(cfg))
    pipeline = tmp_path / "pipeline"
    save_flow_model(model, pipeline / "transformer")
    index = {"_class_name": "Cosmos2_5_PredictBasePipeline"}
    index["transformer"] = ["diffusers", "CosmosTransformer3DModel"]  # type: ignore[assignment]
    (pipeline / "model_index.json").write_text(json.dumps(index))
    named = {**cfg, "policy": {**cfg["policy"], "model_name_or_path": str(pipeline)}}
    check_flow_model(config_from_dict(named))
    assert isinstance(load_flow_model(config_from_dict(named)), DiffusersFlowModel)

    latent = tmp_path / "latent"
    CosmosTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=16,
        num_layers=1, text_embed_dim=32, adaln_lora_dim=8, max_size=(2, 8, 8),
        concat_padding_mask=False, encoder_hidden_states_channels=32,
    ).save_pretrained(str(latent))  # fmt: skip
    named = {**cfg, "policy": {**cfg["policy"], "model_name_or_path": str(latent)}}
    with pytest.raises(
        ValueError,
        match=r"policy.model_name_or_path: .*latent-space .*in_channels = 16\) without its VAE",
    ):
        check_flow_model(config_from_dict(named))


def test_flow_grpo_trains_a_diffusers_model_in_one_process(tmp_path):
    """`nebula-rl train --local` with the tiny Cosmos transformer: three iterations run, the
    weights move, and the export loads as the starting model of another run."""
    from nebula_rl.flow import job

    cfg = config_from_dict(_cfg(tmp_path, "tiny:cosmos_transformer3d"))
    start = load_flow_model(cfg)
    run_dir = job.run(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(0 <= r["reward_mean"] <= 1 for r in records)
    final = run_dir / "safetensors" / "final"
    trained = load_flow_model(
        config_from_dict(
            {**_cfg(tmp_path, "x"), "policy": {**_cfg(tmp_path, str(final))["policy"]}}
        )
    )
    moved = [
        not torch.equal(a, b)
        for a, b in zip(start.state_dict().values(), trained.state_dict().values(), strict=True)
    ]
    assert any(moved)


COSMOS_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


def test_lora_trains_only_the_adapter_and_exports_merged_weights_and_the_adapter(tmp_path):
    """`policy.lora` on the tiny Cosmos transformer: only the adapter's weights train (two
    FlowGRPO iterations move them and leave the base as it was); the export holds the merged
    weights, which load back as a plain model giving the adapted model's velocity, and the
    adapter as peft saves it, which `lora_path` starts from (refused when it does not fit)."""
    from safetensors.torch import load_file

    from nebula_rl.flow.data import make_toy_dataset, read_local_dataset
    from nebula_rl.flow.local import FlowRLSettings, run_flow_rl

    raw = _cfg(tmp_path, "tiny:cosmos_transformer3d")
    raw["policy"]["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": COSMOS_ATTENTION}
    model = load_flow_model(config_from_dict(raw))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clips = read_local_dataset(
        make_toy_dataset(tmp_path / "data", clips_per_prompt=1, size=8), num_frames=2
    )
    settings = FlowRLSettings(
        num_iterations=2, prompts_per_iteration=2, group_size=4, sample_steps=4, clip_range=1e-3
    )
    run_flow_rl(model, clips, settings, score=lambda x, _: x.mean(dim=(1, 2, 3, 4)).tolist())
    for name, param in model.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == (".lora_B." in name or ".lora_A." in name), name

    folder = save_flow_model(model, tmp_path / "export")
    adapter = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(COSMOS_ATTENTION)
    assert adapter and all("lora_" in k for k in adapter)
    merged = load_flow_model(
        config_from_dict({**raw, "policy": {**_cfg(tmp_path, str(folder))["policy"]}})
    )
    assert not any(p.requires_grad is False for p in merged.parameters())  # a plain model
    x, sigma, text, mask = _inputs(2)
    assert torch.allclose(merged(x, sigma, text, mask), model(x, sigma, text, mask), atol=1e-5)
    # lora_path: the same base with the exported adapter is the trained model again
    raw["policy"]["lora"]["lora_path"] = str(folder / "adapter")
    resumed = load_flow_model(config_from_dict(raw))
    assert {n for n, p in resumed.named_parameters() if p.requires_grad} == trainable
    assert torch.equal(resumed(x, sigma, text, mask), model(x, sigma, text, mask))
    raw["policy"]["lora"]["r"] = 2
    with pytest.raises(
        ValueError, match=r"policy\.lora\.lora_path: the adapter was trained with r = 4"
    ):
        load_flow_model(config_from_dict(raw))
    raw["policy"]["lora"] |= {"r": 4, "target_modules": ["to_q"]}
    with pytest.raises(ValueError, match=r"policy\.lora\.lora_path: the adapter's modules differ"):
        load_flow_model(config_from_dict(raw))


def test_lora_keys_are_checked(tmp_path):
    raw = _cfg(tmp_path, "tiny:cosmos_transformer3d")
    raw["policy"]["lora"] = {"r": 4}
    with pytest.raises(ValueError, match=r"policy\.lora\.target_modules: name the modules"):
        load_flow_model(config_from_dict(raw))
    raw["policy"]["lora"] = {"r": 4, "target_modules": ["to_q"], "lora_names": ["a", "b"]}
    with pytest.raises(ValueError, match=r"policy\.lora\.lora_names = \['a', 'b'\]"):
        load_flow_model(config_from_dict(raw))
    raw["policy"]["lora"] = {"r": 4, "target_modules": ["to_q"], "lora_path": str(tmp_path)}
    with pytest.raises(ValueError, match=r"policy\.lora\.lora_path = .*: no adapter_config"):
        load_flow_model(config_from_dict(raw))
    raw["policy"]["lora"] = {"r": 4, "target_modules": ["to_q"], "primary_adapter": "old"}
    with pytest.raises(ValueError, match=r'primary_adapter = "old": must name the adapter'):
        load_flow_model(config_from_dict(raw))
