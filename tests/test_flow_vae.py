"""Latent-space world models (`nebula_rl.flow.vae`): a diffusers transformer with its pipeline's
VAE samples, records and trains on latents; the frozen VAE normalises latents as the pipelines
do, decodes the final latents to pixels for the rewards, and stays out of the optimiser, the
weight push, checkpoints and the trained weights; exports are pipeline folders that load back;
a pipeline folder written with diffusers' `save_pretrained` loads through
`policy.model_name_or_path`; what cannot run is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderDC, AutoencoderKL, AutoencoderKLWan, WanTransformer3DModel

from flow_configs import reward_service, scored_remotely, tiny_flow_config, tiny_flow_policy
from nebula_rl.config import ConfigError, config_from_dict
from nebula_rl.flow.data import make_toy_dataset, read_local_dataset
from nebula_rl.flow.diffusers_models import PRESET_VAES, tiny_vae_config
from nebula_rl.flow.ema import FlowTrainingState
from nebula_rl.flow.local import FlowRLSettings, pretrain, run_flow_rl
from nebula_rl.flow.models import check_flow_model, load_flow_model, save_flow_model
from nebula_rl.flow.vae import FlowVAE, flow_vae

FRAMES = {"tiny:sd3_transformer2d_latent": 1, "tiny:sana_transformer2d_latent": 1}
"""Frames of each latent preset in these tests (Wan's VAE: 1 + 4k; SD3 and Sana make images)."""


def _cfg(tmp_path: Path, model: str, *, frames: int = 5, **train_policy: object) -> dict:
    """A small world-model FlowGRPO config (8 x 8 pixels, 16 toy clips) of `model`."""
    policy = tiny_flow_policy(model, frames=frames, train_flow_shift=1.0)
    return tiny_flow_config(tmp_path / "runs", policy, timestamp="latent", **train_policy)


def _named(cfg: dict, model: str) -> dict:
    return {**cfg, "policy": {**cfg["policy"], "model_name_or_path": model}}


def _inputs(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, *shape, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.1])
    text = torch.randn(3, 4, 32, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    return x, sigma, text, mask


@pytest.mark.parametrize("preset", sorted(PRESET_VAES))
def test_a_latent_preset_runs_in_its_vaes_latent_space_and_exports_a_pipeline(tmp_path, preset):
    """The transformer takes and gives the VAE's latents; the VAE is frozen and no part of the
    model's parameters or state; the export is a pipeline folder (`transformer/`, `vae/`,
    `model_index.json`) that loads back with the same velocity and the same VAE."""
    frames = FRAMES.get(preset, 5)
    cfg = _cfg(tmp_path, preset, frames=frames)
    model = load_flow_model(config_from_dict(cfg), seed=3)
    vae = flow_vae(model)
    assert vae is not None and vae.kind == PRESET_VAES[preset]
    shape = vae.latent_shape((3, frames, 8, 8))
    assert shape == (4, 1 + (frames - 1) // 2, 4, 4)  # (4 channels, halved in time and size)
    x, sigma, text, mask = _inputs(shape)
    v = model(x, sigma, text, mask)
    assert v.shape == x.shape and torch.isfinite(v).all()
    assert vae.decode(x).shape == (3, 3, frames, 8, 8)

    assert not any(p.requires_grad for p in vae.module.parameters())
    vae_params = {id(p) for p in vae.module.parameters()}
    assert not vae_params & {id(p) for p in model.parameters()}
    assert not any(k.startswith("vae") for k in model.state_dict())

    folder = save_flow_model(model, tmp_path / "export")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", PRESET_VAES[preset]]
    assert (folder / "transformer" / "config.json").is_file()
    assert (folder / "vae" / "config.json").is_file()
    back = load_flow_model(config_from_dict(_named(cfg, str(folder))))
    assert torch.equal(back(x, sigma, text, mask), v)
    back_vae = flow_vae(back)
    assert back_vae is not None and back_vae.kind == vae.kind
    assert torch.equal(back_vae.decode(x), vae.decode(x))


def test_latents_are_normalised_as_the_pipelines_do():
    """Wan (and Cosmos-Predict2.5): `(mu - latents_mean) / latents_std` per channel; SD3:
    `(mu - shift_factor) * scaling_factor`; the posterior's mean; Sana's DC-AE: its latent times
    `scaling_factor`; decoding inverts the normalisation before the VAE's decoder."""
    torch.manual_seed(0)
    pixels = torch.rand(2, 3, 5, 8, 8) * 2 - 1
    wan = AutoencoderKLWan(**tiny_vae_config("AutoencoderKLWan")).eval()
    vae = FlowVAE(wan)
    mu = wan.encode(pixels).latent_dist.mean
    mean = torch.tensor(wan.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(wan.config.latents_std).view(1, 4, 1, 1, 1)
    z = vae.encode(pixels)
    assert torch.allclose(z, (mu - mean) / std, atol=1e-5)
    assert torch.allclose(vae.decode(z), wan.decode(mu).sample.clamp(-1, 1), atol=1e-5)

    kl = AutoencoderKL(**tiny_vae_config("AutoencoderKL")).eval()
    vae = FlowVAE(kl)
    mu = kl.encode(pixels[:, :, 0]).latent_dist.mean
    z = vae.encode(pixels[:, :, :1])
    expected = (mu - kl.config.shift_factor) * kl.config.scaling_factor
    assert torch.allclose(z[:, :, 0], expected, atol=1e-5)
    decoded = kl.decode(expected / kl.config.scaling_factor + kl.config.shift_factor).sample
    assert torch.allclose(vae.decode(z)[:, :, 0], decoded.clamp(-1, 1), atol=1e-5)

    dc = AutoencoderDC(**tiny_vae_config("AutoencoderDC")).eval()  # (Sana: no distribution)
    vae = FlowVAE(dc)
    expected = dc.encode(pixels[:, :, 0]).latent * dc.config.scaling_factor
    z = vae.encode(pixels[:, :, :1])
    assert torch.allclose(z[:, :, 0], expected, atol=1e-5)
    decoded = dc.decode(expected / dc.config.scaling_factor).sample
    assert torch.allclose(vae.decode(z)[:, :, 0], decoded.clamp(-1, 1), atol=1e-5)


def _write_pipeline(folder: Path, *, in_channels: int = 4, vae: str = "AutoencoderKLWan") -> Path:
    """A Wan text-to-video pipeline folder written by diffusers' `save_pretrained`."""
    torch.manual_seed(1)
    WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
        in_channels=in_channels, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
        num_layers=1, rope_max_seq_len=32,
    ).save_pretrained(str(folder / "transformer"))  # fmt: skip
    AutoencoderKLWan(**tiny_vae_config("AutoencoderKLWan")).save_pretrained(str(folder / "vae"))
    index = {
        "_class_name": "WanPipeline",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", vae],
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_a_pipeline_folder_loads_as_a_latent_model_and_what_cannot_run_is_refused(tmp_path):
    folder = _write_pipeline(tmp_path / "wan")
    cfg = _named(_cfg(tmp_path, "x"), str(folder))
    check_flow_model(config_from_dict(cfg))
    model = load_flow_model(config_from_dict(cfg))
    vae = flow_vae(model)
    assert vae is not None and vae.kind == "AutoencoderKLWan"
    x, sigma, text, mask = _inputs(vae.latent_shape((3, 5, 8, 8)))
    assert model(x, sigma, text, mask).shape == x.shape

    def refused(config: dict, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            check_flow_model(config_from_dict(config))

    refused(  # the transformer alone: no VAE
        _named(cfg, str(folder / "transformer")), r"policy\.model_name_or_path: .* without its VAE"
    )
    refused(
        _named(cfg, str(_write_pipeline(tmp_path / "i2v", in_channels=6))),
        r"takes 6 channels and gives 4, its VAE's latents have 4",
    )
    refused(
        _named(cfg, str(_write_pipeline(tmp_path / "cosmos1", vae="AutoencoderKLCosmos"))),
        r"AutoencoderKLCosmos is Cosmos-Predict1's tokenizer",
    )
    for frames in (2, 4):  # (not 1 + 4k)
        odd = _cfg(tmp_path, "x", frames=frames)
        refused(_named(odd, str(folder)), rf"policy\.diffusers\.inference_frames = {frames}: ")
    small = _named(cfg, str(folder))
    small["policy"]["diffusers"]["inference_size"] = [8, 7]
    refused(small, r"policy\.diffusers\.inference_size = \[8, 7\]: .* multiples of 2")


def test_tokenizer_keys_act_or_are_refused_by_name(tmp_path):
    """`compile_encode` is read (refused for a pixel-space model, which has no VAE); the others
    are refused by name with their reason, at any value but their default."""
    for key, value, why in [
        ("chunk_duration", 33, "one causal pass"),
        ("temporal_window", 4, "4 frames .* per pass"),
        ("load_mean_std", True, "per-frame latent statistics"),
    ]:
        cfg = _cfg(tmp_path, "tiny:wan_transformer3d_latent")
        cfg["policy"]["diffusers"]["tokenizer"] = {key: value}
        with pytest.raises(
            ConfigError, match=rf"policy\.diffusers\.tokenizer\.{key} = .*: .*{why}"
        ):
            config_from_dict(cfg)
    cfg = _cfg(tmp_path, "tiny:wan_transformer3d_latent")
    cfg["policy"]["diffusers"]["tokenizer"] = {"compile_encode": True, "chunk_duration": 81}
    check_flow_model(config_from_dict(cfg))  # (keys at their defaults ask for nothing)
    pixel = _cfg(tmp_path, "tiny:wan_transformer3d", frames=2)
    pixel["policy"]["diffusers"]["tokenizer"] = {"compile_encode": True}
    with pytest.raises(ValueError, match=r"compile_encode = true: .* has no VAE to compile"):
        check_flow_model(config_from_dict(pixel))


@pytest.mark.slow
def test_compile_encode_compiles_the_encoder_to_the_same_latents(tmp_path):
    """~40 s on 2 CPU cores (inductor compiles the tiny VAE's encoder)."""
    from torch._dynamo.utils import counters

    cfg = _cfg(tmp_path, "tiny:wan_transformer3d_latent")
    plain = flow_vae(load_flow_model(config_from_dict(cfg)))
    cfg["policy"]["diffusers"]["tokenizer"] = {"compile_encode": True}
    compiled = flow_vae(load_flow_model(config_from_dict(cfg)))
    assert plain is not None and compiled is not None
    pixels = torch.rand(2, 3, 5, 8, 8) * 2 - 1
    graphs = counters["stats"]["unique_graphs"]
    assert torch.allclose(compiled.encode(pixels), plain.encode(pixels), atol=1e-5)
    assert counters["stats"]["unique_graphs"] > graphs


def test_ddrl_and_sft_train_on_latents_and_rewards_see_pixels(tmp_path):
    """DDRL (its data term on the encoded clips) and SFT on a latent preset: the scorer gets
    decoded pixels [B, 3, 5, 8, 8] in [-1, 1] while the transformer moves; the VAE's weights
    never move; the weight push (`named_parameters`) and checkpoints (`FlowTrainingState`) hold
    the transformer only; the SFT loss falls."""
    model = load_flow_model(config_from_dict(_cfg(tmp_path, "tiny:wan_transformer3d_latent")))
    vae = flow_vae(model)
    assert vae is not None and vae.kind == "AutoencoderKLWan"
    frozen = {k: v.clone() for k, v in vae.module.state_dict().items()}
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    clips = read_local_dataset(
        make_toy_dataset(tmp_path / "data", clips_per_prompt=1, size=8, frames=5), num_frames=5
    )
    seen: list[tuple[int, ...]] = []

    def score(pixels: torch.Tensor, prompts: object) -> list[float]:
        seen.append(tuple(pixels.shape))
        assert pixels.min() >= -1 and pixels.max() <= 1
        return pixels.mean(dim=(1, 2, 3, 4)).tolist()

    settings = FlowRLSettings(
        algorithm="ddrl", num_iterations=2, prompts_per_iteration=2, group_size=4,
        sample_steps=4, clip_range=1e-3, data_beta=0.1,
    )  # fmt: skip
    records = run_flow_rl(model, clips, settings, score=score)
    assert seen == [(8, 3, 5, 8, 8)] * 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["data_distance"] > 0 for r in records)
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert all(torch.equal(v, frozen[k]) for k, v in vae.module.state_dict().items())
    assert all(n.startswith("transformer.") for n, _ in model.named_parameters())
    state = FlowTrainingState(model, None, None).state_dict()
    assert state and all(k.startswith("model.transformer.") for k in state)

    losses = pretrain(model, clips, steps=30, batch_size=8, lr=2e-3)
    assert sum(losses[-5:]) < sum(losses[:5])
    assert all(torch.equal(v, frozen[k]) for k, v in vae.module.state_dict().items())


@pytest.mark.parametrize("given", [0, 1], ids=["t2v", "ti2v"])
def test_flow_grpo_runs_a_latent_model_from_its_config(tmp_path, given):
    """`nebula-rl train --local` with the latent Wan preset, also with a given first frame (as
    Wan 2.2 TI2V takes it: per-token timesteps): three iterations with finite losses and
    rewards of decoded pixels, a sample grid of pixel frames, and an export that loads as the
    starting model of another run."""
    from PIL import Image

    from nebula_rl.flow import job

    raw = _cfg(tmp_path, "tiny:wan_transformer3d_latent")
    raw["policy"]["diffusers"]["max_num_conditional_frames"] = given
    raw["logging"] = {"multi_modal_log_interval": 3}
    run_dir = job.run(config_from_dict(raw))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert all(0 <= r["reward_mean"] <= 1 and r["data_distance"] > 0 for r in records)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    grid = Image.open(run_dir / "samples" / "step_3.png")
    assert grid.size == (4 * 5 * 8, 8 * 8)  # (4 samples x 5 frames of 8 px; 8 captions)
    final = run_dir / "safetensors" / "final"
    trained = load_flow_model(config_from_dict(_named(raw, str(final))))
    assert flow_vae(trained) is not None


def test_the_reward_service_scores_a_latent_models_decoded_pixels(tmp_path, monkeypatch):
    """With `use_remote_reward`, a latent-space run sends its decoded clips (uint8, `media_type =
    "video"`; the service would refuse 4-channel latents), and the service's rewards equal the
    same run's in-process ones, iteration by iteration."""
    from nebula_rl.flow import job

    local = _cfg(tmp_path / "local", "tiny:wan_transformer3d_latent")
    expected = job.run(config_from_dict(local)) / "metrics.jsonl"
    with reward_service(monkeypatch, "brightness"):
        remote = _cfg(tmp_path / "remote", "tiny:wan_transformer3d_latent")
        scored_remotely(remote, "brightness", weight=1.0, batch_size=8)
        got = job.run(config_from_dict(remote)) / "metrics.jsonl"

    def rewards(path: Path) -> list[float]:
        return [json.loads(line)["reward_mean"] for line in path.read_text().splitlines()]

    assert rewards(got) == pytest.approx(rewards(expected), abs=1e-6)
    assert [json.loads(line)["rewards_lost"] for line in got.read_text().splitlines()] == [0] * 3


def test_a_hub_pipeline_fetch_takes_only_the_parts_the_run_needs():
    from nebula_rl.flow.models import pipeline_file

    # (the scheduler and Cosmos 3's text_tokenizer are small: an export is a whole pipeline)
    wanted = ["model_index.json", "transformer/config.json",
              "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
              "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
              "config.json", "diffusion_pytorch_model.safetensors",
              "scheduler/scheduler_config.json", "text_tokenizer/tokenizer.json"]  # fmt: skip
    unwanted = ["text_encoder/model.safetensors", "text_encoder/config.json",
                "tokenizer/tokenizer.json",
                "transformer/extra/weights.safetensors", "README.md"]  # fmt: skip
    assert all(pipeline_file(f) for f in wanted)
    assert not any(pipeline_file(f) for f in unwanted)
    texts = ["text_encoder/model.safetensors", "text_encoder_3/config.json",
             "tokenizer/tokenizer.json", "tokenizer_2/vocab.json"]  # fmt: skip
    assert all(pipeline_file(f, text=True) for f in wanted + texts)  # (captions to embed)
    assert not any(pipeline_file(f, text=True) for f in unwanted[3:])
