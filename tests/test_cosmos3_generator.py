"""Cosmos 3's generator (diffusers' `Cosmos3OmniTransformer`) as a world-model policy: its
velocity is the transformer's output on the sequence its own pipeline packs, an export is a
pipeline `Cosmos3OmniPipeline.from_pretrained` loads and runs, and FlowGRPO trains it in the
asynchronous runtime, scored by the reward service (`flow.cosmos3`)."""

import json
from pathlib import Path

import pytest
import torch

from nebula_rl.config import config_from_dict
from nebula_rl.flow.models import load_flow_model, save_flow_model

PRESET = "tiny:cosmos3_omni_generator"
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "cosmos3"


def _cfg(**diffusers) -> object:
    return config_from_dict(
        {
            "train": {"train_policy": {"type": "grpo", "trainer_type": "flow_grpo",
                                       "reward_function": "brightness"}},
            "policy": {"model_name_or_path": PRESET, "is_diffusers": True,
                       "diffusers": {"is_video": True, "inference_size": [16, 16],
                                     "inference_frames": 5, "train_frames": 5, **diffusers}},
        }
    )  # fmt: skip


def test_the_velocity_is_the_transformers_on_its_pipelines_own_sequence():
    """The pipeline's own denoising loop (its tokenizer, templates, packing and timesteps) calls
    the transformer; the flow model's velocity on the same latents, noise level and caption is
    that call's output, for a batch of two captions and the unconditional prompt."""
    model = load_flow_model(_cfg(), seed=3)
    prompts = model.text_encoder
    pipe = prompts.pipeline
    calls = []

    def keep(module, args, kwargs, output):
        calls.append((kwargs, output[0][0].detach().clone()))

    hook = model.transformer.register_forward_hook(keep, with_kwargs=True)
    latents = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    pipe("a red square", num_frames=5, height=16, width=16, num_inference_steps=2,
         guidance_scale=3.0, latents=latents.clone(), output_type="latent",
         enable_safety_check=False)  # fmt: skip
    hook.remove()
    assert len(calls) == 4  # (two steps, each conditional and unconditional)
    for (kwargs, want), caption in zip(calls[:2], ["a red square", ""], strict=True):
        x = kwargs["vision_tokens"][0]
        sigma = kwargs["vision_timesteps"][:1] / 1000
        text = prompts(["a blue bar", caption])  # (the other row: a batch of two)
        mask = (text[..., 0] > 0).float()
        got = model(torch.cat([x, x]), torch.cat([sigma, sigma]), text, mask)
        assert got.shape == (2, 4, 3, 8, 8)
        assert torch.allclose(got[1], want[0], atol=1e-6)
        assert not torch.allclose(got[0], want[0], atol=1e-3)  # (the caption matters)
    assert torch.equal(calls[0][0]["input_ids"], torch.tensor(prompts.ids("a red square")))


def test_runs_feed_it_their_captions_tokens_not_stored_embeddings(tmp_path):
    """The toy clips carry stored text embeddings (for the other models); the batches every
    trainer, rollout and validation build for this model hold their captions' prompt ids, and
    guidance's unconditional rows the pipeline's negative prompt's."""
    from nebula_rl.flow.data import Clip, clip_text, make_toy_dataset, read_local_dataset
    from nebula_rl.flow.text_encoder import flow_text_encoder

    model = load_flow_model(_cfg())
    root = make_toy_dataset(tmp_path, clips_per_prompt=1, frames=5, size=16)
    clips = read_local_dataset(root, num_frames=5)[:2]
    assert all(c.text is not None for c in clips)
    encoder = flow_text_encoder(model)
    text, mask = clip_text(clips, encoder)
    assert torch.equal(text, model.text_encoder([c.caption for c in clips]))
    assert mask.sum(dim=1).tolist() == [len(model.text_encoder.ids(c.caption)) for c in clips]
    null, _ = clip_text([Clip("null", encoder.negative_prompt, None, None)], encoder)
    assert (null[0, :, 0][null[0, :, 0] > 0] - 1).long().tolist() == model.text_encoder.ids("")


def test_the_export_is_a_pipeline_its_class_loads_and_runs(tmp_path):
    """`Cosmos3OmniPipeline.from_pretrained` loads an export (transformer, trained VAE,
    tokenizer, scheduler) and samples with it; nebula-rl loads it back as the same model."""
    import diffusers

    model = load_flow_model(_cfg(), seed=1)
    save_flow_model(model, tmp_path / "export")
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert index["_class_name"] == "Cosmos3OmniPipeline"
    pipe = diffusers.Cosmos3OmniPipeline.from_pretrained(str(tmp_path / "export"))
    video = pipe("a red square", num_frames=5, height=16, width=16, num_inference_steps=2,
                 guidance_scale=1.0, output_type="pt", enable_safety_check=False).video  # fmt: skip
    assert video.shape == (5, 3, 16, 16) and torch.isfinite(video).all()
    cfg = _cfg()
    cfg.policy.model_name_or_path = str(tmp_path / "export")
    again = load_flow_model(cfg)
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert again.text_encoder.ids("a red square") == model.text_encoder.ids("a red square")


def test_image_conditioned_velocity_is_the_pipelines_too():
    """The pipeline's image-to-world mode (a given first latent frame, clean and out of the
    noisy tokens): the flow model told that frame is given answers the transformer's call."""
    from PIL import Image

    model = load_flow_model(_cfg(max_num_conditional_frames=1), seed=5)
    prompts = model.text_encoder
    calls = []
    hook = model.transformer.register_forward_hook(
        lambda m, a, kw, out: calls.append((kw, out[0][0].detach().clone())), with_kwargs=True
    )
    prompts.pipeline("a red square", image=Image.new("RGB", (16, 16), (200, 30, 30)),
                     num_frames=5, height=16, width=16, num_inference_steps=2,
                     guidance_scale=1.0, output_type="latent", enable_safety_check=False)  # fmt: skip
    hook.remove()
    kwargs, want = calls[1]
    assert kwargs["vision_noisy_frame_indexes"][0].tolist() == [1, 2]
    x, sigma = kwargs["vision_tokens"][0], kwargs["vision_timesteps"][:1] / 1000
    text = prompts(["a red square"])
    got = model(x, sigma, text, (text[..., 0] > 0).float(), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))  # (a given frame stays)


def test_context_parallelism_takes_equal_shares_of_the_latent_patches():
    """`cp_size` splits the generator's latent patches (tests/test_flow_parallel.py runs it):
    5 frames of 16 x 16 pixels are 3 latent frames of 4 x 4 patches, 48 in all, which 2 ranks
    share and 5 cannot."""
    from nebula_rl.flow.models import check_flow_model

    cfg = _cfg()
    cfg.policy.parallelism.cp_size = 2
    check_flow_model(cfg)
    cfg.policy.parallelism.cp_size = 5
    with pytest.raises(ValueError, match=r"cp_size \(5\) must divide the 48 latent patches"):
        check_flow_model(cfg)


@pytest.mark.parametrize(
    ("trainer", "extra"),
    [("sft", {}), ("ddrl", {"data_beta": 0.1}), ("diffusion_nft", {}), ("flow_grpo", {})],
    ids=["sft", "ddrl", "nft", "flow_grpo-given-frames"],
)
def test_each_trainer_steps_the_generator(tmp_path, trainer, extra):
    """Flow-matching SFT on the toy clips, DDRL (its data term on them too), DiffusionNFT, and
    FlowGRPO with a given first frame each take their steps on the generator in one process and
    move its weights."""
    from flow_configs import tiny_flow_config, tiny_flow_policy
    from nebula_rl.flow import job

    given = {"max_num_conditional_frames": 1} if trainer == "flow_grpo" else {}
    policy = tiny_flow_policy(PRESET, frames=5, size=8, train_flow_shift=1.0, **given)
    data = tiny_flow_config(tmp_path, policy, trainer=trainer, max_num_steps=2, **extra)
    if trainer == "sft":
        data["train"]["train_policy"] = {
            "type": "sft", "trainer_type": "diffusers_sft", "mini_batch": 4,
            "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 2}},
        }  # fmt: skip
    cfg = config_from_dict(data)
    before = load_flow_model(cfg).state_dict()
    run = job.run(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    cfg.policy.model_name_or_path = str(run / "safetensors" / "final")
    after = load_flow_model(cfg).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_the_cpu_twin_learns_asynchronously_through_the_reward_service(tmp_path):
    """`make cosmos3-demo`'s generator half, shortened: the reward service in its own process,
    then the CPU twin's job (a controller, a policy replica, a rollout replica sampling with
    weights up to one step old); every sample is scored by the service (none lost), and the
    brightness of the last 8 steps beats the first 8's (the trained VAE decodes what the
    transformer learns to make)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "nebula_rl.flow.cosmos3_demo", "--output-dir", str(tmp_path),
         "--steps", "30", "--config", str(CONFIGS / "gen_flow_grpo_cpu.toml")],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUMMARY cosmos3 generator" in out.stdout
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "reward_mean" in r]
    assert len(records) == 30
    assert all(r["rewards_lost"] == 0 and r["staleness_max"] <= 1 for r in records)
    rewards = [r["reward_mean"] for r in records]
    assert sum(rewards[-8:]) / 8 > sum(rewards[:8]) / 8 + 0.01, rewards


def test_a_prompt_file_validates_a_run_on_clips(tmp_path):
    """Other models refuse captions beside stored embeddings (text from two encoders); this one
    reads every caption's tokens, so a prompt file may validate a run on clips."""
    from nebula_rl.flow.models import check_flow_model

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue bar\n")
    cfg = _cfg()
    cfg.validation.enable = True
    cfg.validation.dataset.name = str(prompts)
    check_flow_model(cfg)
    cfg.policy.model_name_or_path = "tiny:wan_transformer3d_latent"
    with pytest.raises(ValueError, match="text from two encoders"):
        check_flow_model(cfg)
