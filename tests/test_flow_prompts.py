"""Prompt datasets of world-model RL: prompt files and cosmos-rl's prompt sets (fetched once into
the cache), embedded online by the pipeline's own text encoder, trained on by FlowGRPO and
DiffusionNFT; what needs clips is refused."""

from __future__ import annotations

import copy
import functools
import http.server
import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flow_configs import tiny_flow_config, tiny_flow_policy, tiny_text_pipeline
from nebula_rl.config import config_from_dict
from nebula_rl.flow.clips import prompt_entries
from nebula_rl.flow.data import Clip, clip_text, prompt_clips
from nebula_rl.flow.job import flow_clips
from nebula_rl.flow.models import check_flow_model, load_flow_model
from nebula_rl.flow.prompts import PROMPT_SETS, fetch_prompt_set, read_prompt_file
from nebula_rl.flow.text_encoder import PipelineTextEncoder
from nebula_rl.flow.vae import sample_shape

CAPTIONS = ["a red square", "a blue circle", "a green bar", "a yellow square"]
COSMOS_LENGTH = 128
"""Cosmos-Predict2.5's prompt length here: its chat-formatted captions take 108 of the byte-level
tokenizer's tokens at most (its system prompt most of them)."""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return tiny_text_pipeline(tmp_path_factory.mktemp("wan"))


def test_prompt_files_are_read_in_order_and_bad_ones_named(tmp_path):
    (tmp_path / "p.txt").write_text("a red square\n\n  a blue circle \n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a red square", "tag": 1}\n{"prompt": "x"}\n')
    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "one"}, {"prompt": "two"}]))
    assert read_prompt_file(tmp_path / "p.txt", key="k") == ["a red square", "a blue circle"]
    assert read_prompt_file(tmp_path / "p.jsonl", key="k") == ["a red square", "x"]
    assert read_prompt_file(tmp_path / "p.json", key="k") == ["one", "two"]
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"dataset\.name: .*bad\.jsonl: each entry must be an"):
        read_prompt_file(tmp_path / "bad.jsonl", key="dataset.name")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompt_file(tmp_path / "empty.txt", key="k")
    entries = prompt_entries(str(tmp_path / "p.json"), "train", key="k")
    clips = prompt_clips(entries, shape=(3, 5, 8, 8))
    assert [(c.caption, c.video, c.text, c.shape) for c in clips] == [
        ("one", None, None, (3, 5, 8, 8)),
        ("two", None, None, (3, 5, 8, 8)),
    ]


def test_a_prompt_set_is_fetched_once_into_the_cache(tmp_path, monkeypatch):
    """cosmos-rl's prompt sets are downloaded on first use (here from a local server) and read
    from the cache after; a split the set lacks and a failed download are named."""
    served = tmp_path / "served"
    served.mkdir()
    (served / "train.txt").write_text("a red square\na blue circle\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/train.txt"
    monkeypatch.setenv("NEBULA_RL_CACHE", str(tmp_path / "cache"))
    try:
        path = fetch_prompt_set("pickscore", "train", key="k", url=url)
    finally:
        server.shutdown()
        server.server_close()
    assert path == tmp_path / "cache" / "prompt_sets" / "pickscore" / "train.txt"
    assert read_prompt_file(path, key="k") == ["a red square", "a blue circle"]
    assert fetch_prompt_set("pickscore", "train", key="k", url=url) == path  # (server gone)
    with pytest.raises(ValueError, match=r"'dance_grpo_t2v' has the split\(s\) train, not 'test'"):
        fetch_prompt_set("dance_grpo_t2v", "test", key="k")
    with pytest.raises(ValueError, match=r"k: could not fetch prompt set 'ocr' \(train\) from"):
        fetch_prompt_set("ocr", "train", key="k", url=url)
    assert not (tmp_path / "cache" / "prompt_sets" / "ocr" / "train.txt").exists()
    assert not list((tmp_path / "cache").rglob("*.part"))  # (a failed fetch leaves nothing)


def test_the_text_encoder_embeds_as_the_pipeline_does(pipeline):
    """The encoder gives the pipeline's own `encode_prompt` states (zero past each caption's
    tokens), keeps recent captions, and is shared, not copied, by copies of the model."""
    import diffusers

    encoder = PipelineTextEncoder(pipeline, max_length=24)
    out = encoder(CAPTIONS[:2])
    reference = diffusers.WanPipeline.from_pretrained(
        str(pipeline), transformer=None, vae=None, scheduler=None
    ).encode_prompt(CAPTIONS[:2], do_classifier_free_guidance=False, max_sequence_length=24)[0]
    torch.testing.assert_close(out, reference)
    tokens = (out.abs().sum(-1) > 0).sum(1).tolist()
    assert out.shape == (2, 24, 32) and tokens[0] < tokens[1] < 24  # ("circle" is longer)
    again = encoder([CAPTIONS[1], CAPTIONS[0], CAPTIONS[1]])
    torch.testing.assert_close(again, out[[1, 0, 1]])
    assert list(encoder._cache) == [CAPTIONS[0], CAPTIONS[1]]
    assert copy.deepcopy(encoder) is encoder
    prompts = [Clip(f"p{i}", c, None, None, size=(3, 5, 8, 8)) for i, c in enumerate(CAPTIONS)]
    text, mask = clip_text(prompts[:2], encoder)  # (a prompt's mask: its tokens only)
    assert mask.sum(1).tolist() == tokens and torch.equal(text, out)
    with pytest.raises(ValueError, match="p0: a prompt without text embeddings needs the model"):
        clip_text(prompts)
    small = PipelineTextEncoder(pipeline, max_length=24, dtype=torch.bfloat16)
    small.cache_bytes = 2 * 24 * 32 * 2  # (two captions' rows in bf16)
    clip_text(prompts[:2], small)
    text, _ = clip_text(prompts[2:3], small)  # (the oldest caption goes)
    assert text.dtype == torch.bfloat16 and list(small._cache) == CAPTIONS[1:3]


def _prompt_run(
    tmp_path: Path,
    model: str,
    *,
    trainer: str = "flow_grpo",
    frames: int = 5,
    max_prompt_length: int = 24,
    **extra,
) -> dict:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(CAPTIONS) + "\n")
    sample = {"num_steps": 4, "eval_num_steps": 4, "guidance_scale": 1.0}
    data = tiny_flow_config(
        tmp_path,
        tiny_flow_policy(
            model,
            frames=frames,
            train_flow_shift=1.0,
            max_prompt_length=max_prompt_length,
            sample=sample,
        ),
        trainer=trainer,
        max_num_steps=2,
        clip=1e-4,
        **extra,
    )
    data["train"]["train_policy"]["dataset"] = {"name": str(prompts)}
    data["train"]["train_policy"]["reward_function"] = "colour_match"
    return data


def test_flow_grpo_trains_on_prompts_through_the_pipeline_text_encoder(tmp_path, pipeline):
    """A prompt file trains FlowGRPO on the Wan pipeline: the captions are embedded by its text
    encoder, the samples scored, the weights moved; cosmos-rl's validation prompt file is
    sampled and scored; no distance to data is reported."""
    from nebula_rl.flow import job

    data = _prompt_run(tmp_path, str(pipeline))
    (tmp_path / "val.json").write_text(json.dumps([{"prompt": c} for c in CAPTIONS[:2]]))
    data["validation"] = {
        "enable": True,
        "dataset": {"local_dir": str(tmp_path / "val.json")},
        "n_generation": 2,
    }
    cfg = config_from_dict(data)
    check_flow_model(cfg)
    clips = flow_clips(cfg, tmp_path)
    assert [c.caption for c in clips] == CAPTIONS and clips[0].shape == (3, 5, 8, 8)
    start = load_flow_model(cfg)
    assert isinstance(start.text_encoder, PipelineTextEncoder)
    run = job.run(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "iteration" in r] == [1.0, 2.0]
    assert all(r.get("rewards_lost", 0) == 0 and "data_distance" not in r for r in records)
    assert len({r["reward_mean"] for r in records if "reward_mean" in r}) == 2
    validated = [r for r in records if "val/reward_mean" in r]  # (the last step's)
    assert len(validated) == 1 and validated[0]["val/rollout_count"] == 4
    assert not any("val/data_distance" in r for r in records)
    final = run / "safetensors" / "final"
    state = {k: v for f in final.glob("transformer/*.safetensors") for k, v in load_file(f).items()}
    before = start.transformer.state_dict()
    assert any(not torch.equal(state[k], before[k]) for k in before)
    # (the export is a whole pipeline: it embeds the captions as the run did)
    again = load_flow_model(config_from_dict(_prompt_run(tmp_path, str(final))))
    torch.testing.assert_close(again.text_encoder(CAPTIONS), start.text_encoder(CAPTIONS))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model": "tiny:wan_transformer3d_latent"}, "embedded by the model's pipeline text"),
        ({"trainer": "ddrl", "data_beta": 0.1}, r"DDRL's data term \(data_beta = 0\.1\)"),
        ({"max_num_conditional_frames": 1}, r"conditioning frames \(max_num_conditional_fr"),
        ({"sft": True}, "world-model SFT trains on clips"),
    ],
)
def test_what_needs_clips_or_a_text_encoder_is_refused(tmp_path, pipeline, change, match):
    model = change.get("model", str(pipeline))
    extra = {"data_beta": change["data_beta"]} if "data_beta" in change else {}
    data = _prompt_run(tmp_path, model, trainer=change.get("trainer", "flow_grpo"), **extra)
    if "max_num_conditional_frames" in change:
        data["policy"]["diffusers"]["max_num_conditional_frames"] = 1
    if change.get("sft"):
        data["train"]["train_policy"] = {
            "type": "sft",
            "trainer_type": "diffusers_sft",
            "dataset": data["train"]["train_policy"]["dataset"],
        }
    with pytest.raises(ValueError, match=match):
        check_flow_model(config_from_dict(data))


def test_a_pipeline_whose_text_encoder_is_not_run_is_refused(tmp_path, pipeline):
    """A pipeline other than Wan's, SD3's and Cosmos-Predict2.5's is named."""
    index = json.loads((pipeline / "model_index.json").read_text())
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match=r"2_5_PredictBasePipeline, not FluxPipeline's: give"):
        PipelineTextEncoder(flux, max_length=8)
    with pytest.raises(ValueError, match="names no text_encoder and tokenizer"):
        PipelineTextEncoder(tmp_path, max_length=8)


def test_cosmos_rl_validation_prompts_are_read_from_local_dir(tmp_path, pipeline):
    """cosmos-rl's diffusers validation file (`validation.dataset.local_dir`, a JSON list of
    prompts) is a prompt dataset, cut to `validation.max_num_prompts`; a validation set with
    embeddings of its own beside captions the pipeline embeds is refused."""
    (tmp_path / "val.json").write_text(json.dumps([{"prompt": c} for c in CAPTIONS]))
    data = _prompt_run(tmp_path, str(pipeline))
    data["validation"] = {
        "enable": True,
        "dataset": {"local_dir": str(tmp_path / "val.json")},
        "max_num_prompts": 3,
    }
    cfg = config_from_dict(data)
    check_flow_model(cfg)
    assert [c.caption for c in flow_clips(cfg, tmp_path, validation=True)] == CAPTIONS[:3]
    data["validation"]["dataset"] = {"name": "builtin:toy_video"}  # (embeddings of its own)
    with pytest.raises(ValueError, match=r"dataset\.name has captions .* from two encoders"):
        check_flow_model(config_from_dict(data))


def test_stable_diffusion_3_takes_its_pipelines_pooled_vector(tmp_path):
    """SD3's embeddings lead with the pooled vector of its CLIP encoders, which its flow model
    splits off: its velocity is the transformer's on the pipeline's own embeddings and pooled
    vector; a prompt run trains it."""
    import diffusers

    from nebula_rl.flow import job

    folder = tiny_text_pipeline(tmp_path / "sd3", kind="sd3")
    encoder = PipelineTextEncoder(folder, max_length=12)
    out = encoder(CAPTIONS[:2])
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(
        str(folder), transformer=None, vae=None, scheduler=None
    )
    embeds, _, pooled, _ = pipe.encode_prompt(
        CAPTIONS[:2], None, None, do_classifier_free_guidance=False, max_sequence_length=12
    )
    assert out.shape == (2, 1 + 24 + 12, 32)
    torch.testing.assert_close(out[:, 0], pooled)
    torch.testing.assert_close(out[:, 1:], embeds)
    parts = [p for n, p in encoder._pipeline.components.items() if n.startswith("text_encoder")]
    assert len(parts) == 3  # (each frozen, in eval mode, on the encoder's device)
    assert not any(m.training or any(q.requires_grad for q in m.parameters()) for m in parts)

    data = _prompt_run(tmp_path, str(folder), frames=1)
    model = load_flow_model(config_from_dict(data))
    prompts = [Clip(f"p{i}", c, None, None, size=(3, 1, 8, 8)) for i, c in enumerate(CAPTIONS)]
    text, mask = clip_text(prompts[:2], model.text_encoder)
    embeds, _, pooled, _ = pipe.encode_prompt(  # (at the run's max_prompt_length)
        CAPTIONS[:2], None, None, do_classifier_free_guidance=False, max_sequence_length=24
    )
    x, sigma = torch.randn(2, 4, 1, 4, 4), torch.tensor([0.3, 0.7])
    with torch.no_grad():
        velocity = model(x, sigma, text, mask)
        direct = model.transformer(
            x[:, :, 0], encoder_hidden_states=embeds, pooled_projections=pooled,
            timestep=sigma * 1000, return_dict=False,
        )[0].unsqueeze(2)  # fmt: skip
    torch.testing.assert_close(velocity, direct)

    run = job.run(config_from_dict(data))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1.0, 2.0]
    assert all(r["rewards_lost"] == 0 for r in records)


def test_cosmos_predict_embeds_as_its_pipeline_does_and_trains_on_prompts(tmp_path):
    """Cosmos-Predict2.5's Qwen2.5-VL encoder, loaded without the pipeline's guardrail and VAE,
    gives the whole pipeline's `encode_prompt` (every layer's normalised states at every padded
    position) and its negative prompt's; the transformer projects them
    (`crossattn_proj`) as the pipeline does; a prompt run trains it and exports the encoder."""
    import diffusers

    from nebula_rl.flow import job
    from nebula_rl.flow.text_encoder import text_encoders

    folder = tiny_text_pipeline(tmp_path / "cosmos", kind="cosmos")
    encoder = PipelineTextEncoder(folder, max_length=COSMOS_LENGTH)
    out = encoder(CAPTIONS[:2])
    pipe = diffusers.Cosmos2_5_PredictBasePipeline.from_pretrained(
        str(folder), transformer=None, scheduler=diffusers.UniPCMultistepScheduler(),
        safety_checker=torch.nn.Identity(),  # (the guardrail, which embedding never calls)
    )  # fmt: skip
    embeds, negative = pipe.encode_prompt(
        CAPTIONS[:2], max_sequence_length=COSMOS_LENGTH, device=torch.device("cpu")
    )
    assert out.shape == (2, COSMOS_LENGTH, 2 * 32) and not torch.equal(out[0], out[1])
    torch.testing.assert_close(out, embeds)
    torch.testing.assert_close(encoder([encoder.negative_prompt] * 2), negative)
    assert [type(m).__name__ for m in text_encoders(encoder._pipeline)] == [
        "Qwen2_5_VLForConditionalGeneration"
    ]
    assert not any(q.requires_grad for q in encoder._pipeline.text_encoder.parameters())

    data = _prompt_run(tmp_path, str(folder), max_prompt_length=COSMOS_LENGTH)
    start = load_flow_model(config_from_dict(data))
    prompts = [Clip(f"p{i}", c, None, None, size=(3, 5, 8, 8)) for i, c in enumerate(CAPTIONS)]
    text, mask = clip_text(prompts[:2], start.text_encoder)
    x, sigma = torch.randn(2, *sample_shape(start, (3, 5, 8, 8))), torch.tensor([0.3, 0.7])
    embeds = pipe.encode_prompt(  # (at the run's max_prompt_length)
        CAPTIONS[:2], do_classifier_free_guidance=False, max_sequence_length=COSMOS_LENGTH,
        device=torch.device("cpu"),
    )[0]  # fmt: skip
    with torch.no_grad():
        direct = start.transformer(
            x, sigma, embeds, condition_mask=torch.zeros_like(x[:, :1]), return_dict=False
        )[0]
        torch.testing.assert_close(start(x, sigma, text, mask), direct)
    run = job.run(config_from_dict(data))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1.0, 2.0]
    assert all(r["rewards_lost"] == 0 and "data_distance" not in r for r in records)
    final = run / "safetensors" / "final"
    state = {k: v for f in final.glob("transformer/*.safetensors") for k, v in load_file(f).items()}
    before = start.transformer.state_dict()
    assert any(not torch.equal(state[k], before[k]) for k in before)
    again = _prompt_run(tmp_path, str(final), max_prompt_length=COSMOS_LENGTH)
    again = load_flow_model(config_from_dict(again))
    torch.testing.assert_close(again.text_encoder(CAPTIONS), start.text_encoder(CAPTIONS))


def test_world_model_clips_read_from_webdataset_shards_as_from_their_folder(
    tmp_path, pipeline, monkeypatch
):
    """WebDataset shards of cosmos-rl's diffusers layout (`dataset.name` a brace pattern of
    `.tar` files; a caption as `<key>.json` or `<key>.txt`) give the clips their folder gives, in
    the same order, unpacked once into nebula-rl's cache."""
    import webdataset as wds

    monkeypatch.setenv("NEBULA_RL_CACHE", str(tmp_path / "cache"))
    folder = _caption_folder(tmp_path / "folder")
    for shard in (0, 1):
        with wds.TarWriter(str(tmp_path / f"clips-{shard}.tar")) as tar:
            for i in (2 * shard, 2 * shard + 1):
                members = {p.suffix[1:]: p.read_bytes() for p in folder.glob(f"s{i}.*")}
                if i == 1:  # (a plain-text caption)
                    members["txt"] = json.loads(members.pop("json"))["prompt"].encode()
                tar.write({"__key__": f"s{i}", **members})
    data = _prompt_run(tmp_path, str(pipeline), frames=1)
    data["train"]["train_policy"] = {"type": "sft", "trainer_type": "diffusers_sft"}
    data["train"]["train_policy"]["dataset"] = {"local_dir": str(folder)}
    want = flow_clips(config_from_dict(data), tmp_path)
    data["train"]["train_policy"]["dataset"] = {"name": str(tmp_path / "clips-{0..1}.tar")}
    got = flow_clips(config_from_dict(data), tmp_path)
    assert [(c.stem, c.caption) for c in got] == [(c.stem, c.caption) for c in want]
    assert [c.caption for c in got] == CAPTIONS
    for mine, theirs in zip(got, want, strict=True):
        assert torch.equal(mine.video, theirs.video)
    assert len(list((tmp_path / "cache" / "shards").iterdir())) == 2  # (the folder, its lock)


def _caption_folder(root: Path, size: tuple[int, int] = (8, 12)) -> Path:
    """cosmos-rl's diffusers SFT layout: `<stem>.json` captions beside `<stem>.jpg` / `.png`
    images of `size` (height, width), each red in its middle third and blue at the sides."""
    from PIL import Image

    root.mkdir(parents=True)
    height, width = size
    for i, caption in enumerate(CAPTIONS):
        pixels = torch.zeros(height, width, 3, dtype=torch.uint8)
        pixels[..., 2] = 255
        pixels[:, width // 3 : 2 * width // 3] = torch.tensor([255, 0, 0], dtype=torch.uint8)
        (root / f"s{i}.json").write_text(json.dumps({"prompt": caption, "extra": i}))
        Image.fromarray(pixels.numpy()).save(root / f"s{i}.{'png' if i % 2 else 'jpg'}")
    return root


def test_world_model_sft_trains_on_a_cosmos_rl_caption_folder(tmp_path):
    """`dataset.local_dir` in cosmos-rl's diffusers layout (JSON captions beside images) trains
    SD3 with its pipeline's text encoder: images scaled to cover the frame and centre-cropped."""
    from nebula_rl.flow import job

    folder = tiny_text_pipeline(tmp_path / "sd3", kind="sd3")
    data = _prompt_run(tmp_path, str(folder), frames=1)
    data["train"]["train_policy"] = {
        "type": "sft",
        "trainer_type": "diffusers_sft",
        "dataset": {"local_dir": str(_caption_folder(tmp_path / "sft"))},
    }
    data["train"].update(max_num_steps=3, train_batch_per_replica=2, epoch=2)
    cfg = config_from_dict(data)
    check_flow_model(cfg)
    clips = flow_clips(cfg, tmp_path)
    assert [(c.stem, c.caption, c.text) for c in clips] == [
        (f"s{i}", c, None) for i, c in enumerate(CAPTIONS)
    ]
    png = clips[1].video
    assert png is not None and png.shape == (3, 1, 8, 8)
    assert png[:, 0, :, 2:6].tolist() == [[[255] * 4] * 8, [[0] * 4] * 8, [[0] * 4] * 8]
    assert png[0, 0, :, 0].tolist() == [0] * 8  # (the crop keeps 2 blue columns a side)
    run = job.run(cfg)
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    assert (run / "safetensors" / "final" / "text_encoder_3").is_dir()


def _train_shipped(tmp_path: Path, raw: dict) -> tuple[Path, list[dict]]:
    """`nebula-rl train` on the cosmos-rl config `raw` (its `output_dir` in `tmp_path/runs`):
    (its run folder, its records); the command must succeed."""
    from test_flow_parallel import _train_cli

    config = tmp_path / "shipped.json"
    config.write_text(json.dumps(raw))
    result = _train_cli(config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return run_dir, [json.loads(line) for line in lines]


@pytest.mark.slow
def test_cosmos_rls_sd3_sft_config_validates_by_sampling_shrunk(tmp_path, monkeypatch):
    """cosmos-rl's SD3.5 SFT config (offload, a caption folder to train on, a JSON prompt file
    to validate on) runs as shipped on two FSDP2 ranks, its sizes shrunk and the tiny SD3
    pipeline its model: validation samples every prompt once into
    `visual_output/<step>/` (PNGs and their grid), the images a process sampling the exported
    weights makes; a validation reward scores them."""
    import tomllib

    from PIL import Image

    from nebula_rl.flow.job import flow_validation_scorer
    from nebula_rl.flow.validation import validate_samples

    shipped = Path(__file__).parent / "data" / "cosmos-rl" / "configs" / "stable-diffusion-3-5"
    raw = tomllib.loads((shipped / "stable-diffusion-3-5-image-sft.toml").read_text())
    folder = tiny_text_pipeline(tmp_path / "sd3", kind="sd3")
    (tmp_path / "val.json").write_text(json.dumps([{"prompt": c} for c in CAPTIONS]))
    assert raw["policy"]["diffusers"]["offload"] is True
    raw["policy"]["model_name_or_path"] = str(folder)
    raw["policy"]["diffusers"]["inference_size"] = [8, 8]
    raw["policy"]["diffusers"]["sample"]["num_steps"] = 4
    raw["policy"]["parallelism"]["dp_shard_size"] = 2
    raw["logging"]["logger"] = ["console"]
    raw["train"].update(output_dir=str(tmp_path / "runs"), train_batch_per_replica=2)
    raw["train"]["train_policy"]["dataset"]["local_dir"] = str(_caption_folder(tmp_path / "sft"))
    raw["validation"]["dataset"]["local_dir"] = str(tmp_path / "val.json")
    run_dir, records = _train_shipped(tmp_path, raw)
    assert [r["step"] for r in records] == [1, 2]  # (4 clips, 2 a step, one epoch)
    assert records[-1]["val/rollout_count"] == 4 and "val/rollout_count" not in records[0]
    written = run_dir / "visual_output" / "2"
    names = sorted(p.name for p in written.iterdir())
    assert names == ["0000_0_a_red_square.png", "0001_0_a_blue_circle.png",
                     "0002_0_a_green_bar.png", "0003_0_a_yellow_square.png", "grid.png"]  # fmt: skip
    images = [np.asarray(Image.open(written / n)) for n in names[:4]]
    assert np.array_equal(np.asarray(Image.open(written / "grid.png")), np.concatenate(images))

    raw["policy"]["model_name_or_path"] = str(run_dir / "safetensors" / "final")
    raw["validation"]["reward_function"] = "colour_match"
    cfg = config_from_dict(raw)
    clips = flow_clips(cfg, tmp_path, validation=True)
    again = tmp_path / "again"
    metrics, grid = validate_samples(
        load_flow_model(cfg), clips, cfg, step=2, run_dir=again,
        score=flow_validation_scorer(cfg.validation, None),
    )  # fmt: skip
    assert grid == again / "visual_output" / "2" / "grid.png"
    gap = np.abs(np.asarray(Image.open(grid), dtype=int) - np.concatenate(images).astype(int))
    assert gap.mean() < 1.0, gap.max()  # (bf16 on two ranks against one process)
    assert metrics["val/rollout_count"] == 4 and -1 <= metrics["val/reward_mean"] <= 1


def test_colocated_diffusion_nft_trains_on_prompts_on_two_ranks(tmp_path, pipeline):
    """cosmos-rl's NFT layout: DiffusionNFT on a prompt file, a colocated replica of two FSDP2
    ranks of the Wan pipeline; each rank embeds its own captions, every step is recorded once
    and the export keeps the text encoder."""
    from test_flow_parallel import _job, _train_cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(CAPTIONS) + "\n")
    config = _job(
        tmp_path,
        **{
            "policy": {
                **tiny_flow_policy(str(pipeline), frames=5, max_prompt_length=16),
                "parallelism": {"dp_shard_size": 2},
            },
            "train.train_policy.trainer_type": "diffusion_nft",
            "train.train_policy.dataset": {"name": str(prompts)},
        },
    )
    data = json.loads(config.read_text())
    data["policy"]["diffusers"].update(weight_copy_decay_type=1)
    data["policy"]["diffusers"]["sample"]["deterministic_sampling"] = True
    data["logging"] = {}
    config.write_text(json.dumps(data))
    result = _train_cli(config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "colocated"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["rewards_lost"] == 0 and "data_distance" not in r for r in records)
    assert "[rank 1]" in (run_dir / "logs" / "policy-0.log").read_text()  # (one replica)
    index = json.loads((run_dir / "safetensors" / "final" / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]


@pytest.mark.parametrize("kind", ["sd3", "cosmos"])
def test_guidance_conditions_its_unconditional_branch_on_the_negative_prompt(tmp_path, kind):
    """With a pipeline text encoder, classifier-free guidance's unconditional branch sees the
    pipeline's embedding of its default negative prompt (SD3's: empty, yet nonzero;
    Cosmos-Predict2.5's: a description of bad videos), and guides as its pipeline does: SD3's
    `v_u + g (v_c - v_u)`, Cosmos-Predict2.5's `v_c + g (v_c - v_u)`, unguided at g = 1."""
    from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import DEFAULT_NEGATIVE_PROMPT

    from nebula_rl.flow.job import flow_settings
    from nebula_rl.flow.local import rollout_velocity

    frames = 1 if kind == "sd3" else 5
    folder = tiny_text_pipeline(tmp_path / kind, kind=kind)
    length = 24 if kind == "sd3" else COSMOS_LENGTH
    data = _prompt_run(tmp_path, str(folder), frames=frames, max_prompt_length=length)
    data["policy"]["diffusers"]["sample"]["guidance_scale"] = 3.0
    cfg = config_from_dict(data)
    model = load_flow_model(cfg).eval()
    s = flow_settings(cfg, num_iterations=1, prompts=2)
    size = (3, frames, 8, 8)
    prompts = [Clip(f"p{i}", c, None, None, size=size) for i, c in enumerate(CAPTIONS)]
    text, mask = clip_text(prompts[:2], model.text_encoder)
    negative = "" if kind == "sd3" else DEFAULT_NEGATIVE_PROMPT
    null, null_mask = clip_text([Clip("n", negative, None, None)] * 2, model.text_encoder)
    assert null.abs().sum() > 0
    x, sigma = torch.randn(2, *sample_shape(model, size)), torch.tensor([0.3, 0.7])
    with torch.no_grad():
        guided = rollout_velocity(model, text, mask, s, given=None)(x, sigma)
        v_c, v_u = model(x, sigma, text, mask), model(x, sigma, null, null_mask)
        assert (v_c - v_u).abs().max() > 1e-3  # (the text matters)
        unguided = rollout_velocity(model, text, mask, replace(s, guidance_scale=1.0), given=None)
    expected = v_u + 3.0 * (v_c - v_u) if kind == "sd3" else v_c + 3.0 * (v_c - v_u)
    torch.testing.assert_close(guided, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(unguided(x, sigma), v_c)


def test_dataset_split_picks_a_prompt_sets_part(tmp_path, pipeline, monkeypatch):
    """`dataset.split` names the part of a prompt set read (here from the cache); a clip folder
    has no splits, so another split is refused for it."""
    monkeypatch.setenv("NEBULA_RL_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "prompt_sets" / "pickscore"
    cached.mkdir(parents=True)
    (cached / "test.txt").write_text("a cyan circle\na magenta bar\n")
    data = _prompt_run(tmp_path, str(pipeline))
    data["train"]["train_policy"]["dataset"] = {"name": "pickscore", "split": "test"}
    cfg = config_from_dict(data)
    check_flow_model(cfg)
    assert [c.caption for c in flow_clips(cfg, tmp_path)] == ["a cyan circle", "a magenta bar"]
    data["train"]["train_policy"]["dataset"] = {"name": "builtin:toy_video", "split": "test"}
    with pytest.raises(ValueError, match=r"dataset\.split = \['test'\]: a clip folder"):
        flow_clips(config_from_dict(data), tmp_path)


@pytest.mark.parametrize("kind", ["sana", "sana_video"])
def test_sana_embeds_as_its_pipeline_does_and_its_transformer_takes_the_mask(tmp_path, kind):
    """Sana's (and SANA-Video's) Gemma 2 encoder gives its pipeline's `encode_prompt` states,
    zeroed past each caption's tokens, so that the mask read back from them is the pipeline's;
    the velocity is the transformer's on the pipeline's embeddings and mask, at 1000 sigma."""
    import diffusers

    frames = 1 if kind == "sana" else 5
    folder = tiny_text_pipeline(tmp_path / kind, kind=kind)
    data = _prompt_run(tmp_path, str(folder), frames=frames)
    model = load_flow_model(config_from_dict(data))
    size = (3, frames, 8, 8)
    prompts = [Clip(f"p{i}", c, None, None, size=size) for i, c in enumerate(CAPTIONS)]
    text, mask = clip_text(prompts[:2], model.text_encoder)
    pipeline_class = diffusers.SanaPipeline if kind == "sana" else diffusers.SanaVideoPipeline
    pipe = pipeline_class.from_pretrained(str(folder), transformer=None, vae=None, scheduler=None)
    embeds, pipe_mask, _, _ = pipe.encode_prompt(
        CAPTIONS[:2], do_classifier_free_guidance=False, max_sequence_length=24,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert torch.equal(mask, pipe_mask.float()) and 0 < mask.sum(1).min() < 24
    torch.testing.assert_close(text, embeds * pipe_mask[..., None])
    x, sigma = torch.randn(2, *sample_shape(model, size)), torch.tensor([0.3, 0.7])
    with torch.no_grad():
        if kind == "sana":  # (images)
            direct = model.transformer(
                x[:, :, 0], encoder_hidden_states=embeds, encoder_attention_mask=pipe_mask,
                timestep=sigma * 1000, return_dict=False,
            )[0].unsqueeze(2)  # fmt: skip
        else:
            direct = model.transformer(
                x, encoder_hidden_states=embeds, encoder_attention_mask=pipe_mask,
                timestep=sigma * 1000, return_dict=False,
            )[0]  # fmt: skip
        torch.testing.assert_close(model(x, sigma, text, mask), direct)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shipped", "kind", "pipeline", "vae"),
    [
        ("cosmos-predict2-5/cosmos-predict2-5-2b-720-nft", "cosmos",
         "Cosmos2_5_PredictBasePipeline", "AutoencoderKLWan"),
        ("sana/sana-image-nft", "sana", "SanaPipeline", "AutoencoderDC"),
        ("sana/sana-video-nft", "sana_video", "SanaVideoPipeline", "AutoencoderKLWan"),
    ],
    ids=["cosmos-predict2.5", "sana", "sana-video"],
)  # fmt: skip
def test_cosmos_rls_nft_configs_train_shrunk(tmp_path, monkeypatch, shipped, kind, pipeline, vae):
    """cosmos-rl's diffusion NFT configs (colocated DiffusionNFT with LoRA, EMA, bf16,
    activation checkpointing, the dpm2 solver, a prompt set fetched by name) train as shipped:
    only their sizes shrunk, a tiny pipeline of their classes their model and a local reward for
    their remote one; the export is that pipeline, text encoder included."""
    import tomllib

    configs = Path(__file__).parent / "data" / "cosmos-rl" / "configs"
    raw = tomllib.loads((configs / f"{shipped}.toml").read_text())
    folder = tiny_text_pipeline(tmp_path / kind, kind=kind)
    dataset = raw["train"]["train_policy"]["dataset"]  # (pickscore; dance_grpo_t2v for video)
    url = PROMPT_SETS[dataset["name"]][dataset["split"]]
    cached = tmp_path / "cache" / "prompt_sets" / dataset["name"] / url.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    cached.write_text("\n".join(CAPTIONS) + "\n")
    monkeypatch.setenv("NEBULA_RL_CACHE", str(tmp_path / "cache"))
    raw["policy"]["model_name_or_path"] = str(folder)
    raw["policy"]["diffusers"].update(inference_size=[8, 8], inference_frames=5, train_frames=5)
    if kind == "cosmos":
        raw["policy"]["diffusers"]["max_prompt_length"] = COSMOS_LENGTH
    raw["rollout"]["n_generation"] = 2
    for part in ("policy", "rollout"):
        raw[part]["parallelism"]["dp_shard_size"] = 2
    raw["logging"]["logger"] = ["console"]
    raw["train"].update(output_dir=str(tmp_path / "runs"), train_batch_per_replica=4, epoch=1)
    raw["train"]["max_num_steps"] = 2
    policy = raw["train"]["train_policy"]
    policy.update(use_remote_reward=False, reward_function="colour_match", mini_batch=1)
    del policy["remote_reward"]
    run_dir, records = _train_shipped(tmp_path, raw)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rewards_lost"] == 0 and "data_distance" not in r for r in records)
    index = json.loads((run_dir / "safetensors" / "final" / "model_index.json").read_text())
    source = json.loads((folder / "model_index.json").read_text())
    assert (index["_class_name"], index["vae"][1]) == (pipeline, vae)
    assert index["text_encoder"] == source["text_encoder"]


def test_sft_validation_writes_a_video_models_samples_as_clips(tmp_path, pipeline):
    """A video model's validation samples of a prompt file are MP4 clips of its frames (the
    grid's rows hold them side by side, and an animated grid plays them); every caption gets
    `n_generation`, each from its own seed, so two samples of one caption differ."""
    from PIL import Image

    from nebula_rl.flow.data import _read_video
    from nebula_rl.flow.validation import validate_samples

    data = _prompt_run(tmp_path, str(pipeline))
    data["validation"] = {"enable": True, "dataset": {"name": str(tmp_path / "prompts.txt")}}
    data["validation"]["n_generation"] = 2
    cfg = config_from_dict(data)
    clips = flow_clips(cfg, tmp_path, validation=True)
    metrics, grid = validate_samples(load_flow_model(cfg), clips, cfg, step=3, run_dir=tmp_path)
    assert metrics == {"val/rollout_count": 8} and grid is not None
    first = _read_video(grid.parent / "0000_0_a_red_square.mp4")
    second = _read_video(grid.parent / "0000_1_a_red_square.mp4")
    assert first.shape == (5, 8, 8, 3) and not np.array_equal(first, second)
    assert len(list(grid.parent.glob("*.mp4"))) == 8
    assert Image.open(grid).size == (2 * 5 * 8, 4 * 8)  # (2 samples x 5 frames; 4 captions)
    animated = Image.open(grid.with_suffix(".gif"))  # (logged as `val_samples_video`)
    assert (animated.n_frames, animated.size) == (5, (2 * 8, 4 * 8))
