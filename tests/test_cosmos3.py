"""Cosmos 3's reasoner (`Cosmos3OmniForConditionalGeneration`, model type `cosmos3_omni`): the
tiny preset is Qwen3-VL's architecture under Cosmos 3's name, GRPO runs on it through the
vision-language path and exports a model its own class loads, and the shipped configs (the real
model's and their CPU twins, the generator's among them) pass `nebula-rl check`. (The shared
vision-language tests run it too: tests/test_vision.py builds, reloads, batches and SFT-trains
it; tests/test_vision_rl.py checks the engine's log-probs against the policy's on its image,
video and text prompts. The generator: tests/test_cosmos3_generator.py.)"""

import json
from pathlib import Path

import pytest
import torch

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

    assert len(CONFIGS) == 6
    assert main(["check", "--config", str(path)]) == 0, capsys.readouterr().err
