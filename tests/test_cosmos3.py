"""Cosmos 3's reasoner (`Cosmos3OmniForConditionalGeneration`, model type `cosmos3_omni`): the
tiny preset is Qwen3-VL's architecture under Cosmos 3's name, GRPO runs on it through the
vision-language path and exports a model its own class loads, and the shipped configs (the real
model's and their CPU twins, the generator's among them) pass `nebula-rl check`; a reasoner
trained on `builtin:brightness_judge` judges clips by their brightness, as the judged
generator's demo needs. (The shared
vision-language tests run it too: tests/test_vision.py builds, reloads, batches and SFT-trains
it; tests/test_vision_rl.py checks the engine's log-probs against the policy's on its image,
video and text prompts. The generator: tests/test_cosmos3_generator.py.)"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nebula_rl.data.vision import load_image
from nebula_rl.models import load_model

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "cosmos3").glob("*.toml"))


def test_the_reasoner_preset_is_qwen3_vl_under_cosmos3s_name():
    """Same parameters at the same seed and the same logits on an image prompt: the two presets
    differ in their model type and class only (so what the Qwen3-VL preset measured, the
    Cosmos 3 one repeats)."""
    from nebula_rl.data import squares_task
    from nebula_rl.data.vision import VisionProcessor, collate

    cosmos, qwen = load_model("tiny:cosmos3_omni", seed=4), load_model("tiny:qwen3_vl", seed=4)
    assert type(cosmos).__name__ == "Cosmos3OmniForConditionalGeneration"
    assert cosmos.config.model_type == "cosmos3_omni"
    assert cosmos.config.get_text_config().model_type == "qwen3_vl_text"
    mine, theirs = cosmos.state_dict(), qwen.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    processor = VisionProcessor.from_pretrained("tiny:cosmos3_omni")
    sample = processor(squares_task(num_samples=1)[0]["prompt"], add_generation_prompt=True)
    batch = collate(
        [sample],
        pad_token_id=processor.tokenizer.pad_token_id,
        image_token_id=processor.layout.image_token_id,
        video_token_id=processor.layout.video_token_id,
    )
    batch.pop("second_per_grid_ts", None)
    with torch.no_grad():
        torch.testing.assert_close(cosmos(**batch).logits, qwen(**batch).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("preset", "class_name"),
    [
        ("tiny:cosmos3_omni", "Cosmos3OmniForConditionalGeneration"),
        ("tiny:cosmos3_edge", "Cosmos3EdgeForConditionalGeneration"),
    ],
)
def test_grpo_trains_the_reasoner_on_images_and_its_class_loads_the_export(
    tmp_path, preset, class_name
):
    """GRPO in one process on the counting task's images (the built-in engine generates, the
    Cosmos-Reason recipe's rewards score): two steps, and the export loads with the model's own
    class's `from_pretrained` (Nano and Super's; Edge's), every weight found."""
    import transformers

    from nebula_rl import local
    from test_vision import squares_grpo

    run = local.run(squares_grpo(tmp_path, preset, optm_lr=1e-3))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_sequences"] == 8 and r["response_length_mean"] > 0 for r in records)
    export = run / "safetensors" / "final"
    model, info = getattr(transformers, class_name).from_pretrained(
        export, output_loading_info=True
    )
    assert model.config.model_type == preset.removeprefix("tiny:")
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_check_accepts_the_cosmos3_configs(path, capsys):
    """`nebula-rl check` on the real model's configs (Hub ids, 8-GPU layouts; nothing is
    fetched) and their CPU twins."""
    from nebula_rl.cli import main

    assert len(CONFIGS) == 8
    assert main(["check", "--config", str(path)]) == 0, capsys.readouterr().err


def test_the_brightness_judge_task_answers_yes_at_twice_the_brightness():
    """`builtin:brightness_judge`: each row asks the reward service judge's own question about a
    clip (5 frames of 16 x 16 `data:` PNGs, shown at the judge's frame rate) whose measured
    brightness is its pixels' mean; "yes" comes with probability min(1, 2 b): always above
    b = 0.5, and as often as that probability says over the rows; the same seed, the same
    rows."""
    from nebula_rl.config import DatasetConfig
    from nebula_rl.data import load_rows
    from nebula_rl.data.judge import JUDGE_FPS, JUDGE_QUESTION, judge_messages

    rows = load_rows(DatasetConfig(name="builtin:brightness_judge", kwargs={"num_samples": 1500}))
    assert rows == load_rows(
        DatasetConfig(name="builtin:brightness_judge", kwargs={"num_samples": 1500})
    )
    first = rows[0]
    [user, reply] = first["conversations"]
    video, text = user["content"]
    assert video["fps"] == JUDGE_FPS and len(video["video"]) == 5
    assert text["text"].startswith(JUDGE_QUESTION.split("{")[0])
    frames = [load_image(uri) for uri in video["video"]]
    assert frames[0].size == (16, 16)
    pixels = np.stack([np.asarray(f) for f in frames])
    assert first["brightness"] == pytest.approx(pixels.mean() / 255)
    prompt = text["text"].split('"')[1]
    assert judge_messages(video["video"], prompt) == [user] == first["prompt"]
    assert reply == {"role": "assistant", "content": first["answer"]}
    brightness = np.array([r["brightness"] for r in rows])
    yes = np.array([r["answer"] == "yes" for r in rows])
    assert yes[brightness > 0.5].all() and brightness.min() < 0.1 < 0.6 < brightness.max()
    expected = np.minimum(1.0, 2 * brightness)
    assert abs(yes.mean() - expected.mean()) < 0.04  # (1500 draws: a standard error of 0.012)
    dim = brightness < 0.15
    assert abs(yes[dim].mean() - expected[dim].mean()) < 0.1
    with pytest.raises(ValueError, match="unknown option"):
        load_rows(DatasetConfig(name="builtin:brightness_judge", kwargs={"colour": 1}))


@pytest.mark.slow
def test_a_reasoner_trained_as_a_judge_scores_clips_by_their_brightness(tmp_path):
    """configs/cosmos3/judge_sft_cpu.toml, shortened to 100 steps through `nebula-rl train`:
    the trained reasoner, as the reward service's `reasoner_judge`, scores unseen clips with a
    P(yes) that rises with their brightness (at random init it does not track it), which is
    what the judged generator's demo (`make cosmos3-judge-demo`) raises."""
    import subprocess
    import sys

    from nebula_rl.rewards.judge import ReasonerJudge

    config = CONFIGS[0].parent / "judge_sft_cpu.toml"
    subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config),
         "--output-dir", str(tmp_path), "--max-num-steps", "100"],
        check=True, timeout=600,
    )  # fmt: skip
    clips, brightness = _judge_clips(seed=99)
    prompts = ["a red square"] * len(clips)
    scores = np.array(
        ReasonerJudge(str(tmp_path / "judge" / "safetensors" / "final"))(clips, prompts)
    )
    untrained = np.array(ReasonerJudge("tiny:cosmos3_omni")(clips, prompts))
    assert np.corrcoef(brightness, scores)[0, 1] > 0.8
    assert abs(np.corrcoef(brightness, untrained)[0, 1]) < 0.8
    order = np.argsort(brightness)
    quarter = len(order) // 4
    assert scores[order[-quarter:]].mean() > scores[order[:quarter]].mean() + 0.3


def _judge_clips(seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Unseen clips of `builtin:brightness_judge` as uint8 pixels [B, 3, T, H, W], and their
    brightness."""
    from nebula_rl.data.judge import brightness_judge_task

    rows = brightness_judge_task(num_samples=40, seed=seed)
    clips = []
    for row in rows:
        uris = row["prompt"][0]["content"][0]["video"]
        frames = [np.asarray(load_image(uri)) for uri in uris]
        clips.append(torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2))
    return torch.stack(clips), np.array([r["brightness"] for r in rows])
