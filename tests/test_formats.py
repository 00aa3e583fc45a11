"""The row forms of vision-language datasets (`nebula_rl.data.formats`): Cosmos-Reason's
multiple-choice RL rows and media columns, clips fetched into cosmos-rl's cache folder, LLaVA
JSON; each read into conversations and run through a job."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from nebula_rl.config import config_from_dict
from nebula_rl.data import rl_dataset, sft_rows, validate_rows
from nebula_rl.data.formats import CHOICE_INSTRUCTION, FORMAT_INSTRUCTION, cosmos_clips_dir

QA = {"question": "What colour is the cube?", "index2ans": {"A": "red", "B": "green"}}


def _png(path: Path, colour: tuple[int, int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), colour).save(path)


def _mp4(path: Path, colours: list[tuple[int, int, int]], rate: int) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for colour in colours:
            frame = av.VideoFrame.from_image(Image.new("RGB", (32, 32), colour))
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _reason_rl(tmp_path: Path, dataset: dict, **train: object) -> object:
    """A GRPO config of the tiny Qwen3-VL on `dataset`, with the Reason recipe's columns."""
    return config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path / "out"),
                "train_batch_per_replica": 8,
                **train,
                "train_policy": {
                    "type": "grpo",
                    "prompt_column_name": "qa_pairs",
                    "reward_function": ["single_choice", "format"],
                    "dataset": dataset,
                },
            },
            "policy": {"model_name_or_path": "tiny:qwen3_vl", "model_max_length": 300},
            "rollout": {
                "backend": "torch",
                "n_generation": 4,
                "batch_size": 2,
                "max_response_length": 8,
            },
        }
    )


def test_multiple_choice_rows_become_the_recipes_prompt_with_their_media(tmp_path):
    """Cosmos-Reason's RL rows: the lettered choices and instructions in the user's text, an empty
    system turn, the reference from `qa_pairs.answer`; the `image` / `video` column found in the
    media folder (by path, else by file name) with the dataset's settings for its kind; a row
    whose media is missing counted, with its name, and kept out."""
    media = tmp_path / "media"
    _png(media / "scenes" / "a.png", (255, 0, 0))
    _png(media / "deep" / "b.png", (0, 255, 0))
    (media / "clips").mkdir()
    (media / "clips" / "c.mp4").write_bytes(b"not decoded here")
    rows = [
        {"qa_pairs": {**QA, "answer": "A"}, "image": "scenes/a.png"},
        {"qa_pairs": {**QA, "answer": "B"}, "image": "elsewhere/b.png"},  # by file name
        {"qa_pairs": {**QA, "answer": "A"}, "video": "/gone/c.mp4", "image": "scenes/a.png"},
        {"qa_pairs": {**QA, "answer": "B"}, "image": "missing.png"},
        {"qa_pairs": {**QA, "answer": "A"}},
    ]
    _jsonl(tmp_path / "data" / "rl.jsonl", rows)
    dataset = {
        "name": str(tmp_path / "data"),
        "split": "rl",
        "media_dir": str(media),
        "media_settings": {"video": {"fps": 2, "max_pixels": 4096}, "image": {"max_pixels": 1024}},
    }
    train, report = rl_dataset(_reason_rl(tmp_path, dataset))
    assert report.num_bad == 1
    assert report.reasons == {f"media 'missing.png' not found under {media}": 1}
    assert [r["answer"] for r in train] == ["A", "B", "A", "A"]
    system, user = train[0]["qa_pairs"]
    assert system == {"role": "system", "content": ""}
    image, text = user["content"]
    assert image == {"type": "image", "image": str(media / "scenes" / "a.png"), "max_pixels": 1024}
    assert text["text"] == (
        f"What colour is the cube?\n(A) red\n(B) green\n{CHOICE_INSTRUCTION}\n{FORMAT_INSTRUCTION}"
    )
    assert train[1]["qa_pairs"][1]["content"][0]["image"] == str(media / "deep" / "b.png")
    video_turn = train[2]["qa_pairs"][1]["content"]  # the video wins over the image
    assert [item["type"] for item in video_turn] == ["video", "text"]
    assert video_turn[0] == {
        "type": "video",
        "video": str(media / "clips" / "c.mp4"),
        "fps": 2,
        "max_pixels": 4096,
    }
    assert train[3]["qa_pairs"][1]["content"] == text["text"]  # no media: plain text


def test_hub_clips_are_extracted_once_into_cosmos_rls_cache_and_grpo_runs_on_them(
    tmp_path, monkeypatch
):
    """A Reason-shaped dataset read from `local_dir` (the Hub repository's layout): its
    `<subset>/clips/*.tar.gz` extracted once into `$COSMOS_CACHE/datasets/<name>/<subset>/
    video_clips`, rows naming the clips by path found by file name; GRPO in one process then
    generates from the images and MP4 videos (decoded at the recipe's 1 fps), scores the
    letters and trains."""
    from nebula_rl import local

    monkeypatch.setenv("COSMOS_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    colours = {"r.png": (255, 0, 0), "g.png": (0, 255, 0)}
    for name, colour in colours.items():
        _png(tmp_path / "staging" / "frames" / name, colour)
    _mp4(tmp_path / "staging" / "frames" / "b.mp4", [(0, 0, 255)] * 8, rate=4)
    (repo / "robovqa" / "clips").mkdir(parents=True)
    with tarfile.open(repo / "robovqa" / "clips" / "part0.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "staging" / "frames", arcname="frames")
    rows = [
        {"qa_pairs": {**QA, "answer": "A" if n == "r.png" else "B"}, "image": f"clips/x/{n}"}
        for n in colours
    ] * 4 + [{"qa_pairs": {**QA, "answer": "B"}, "video": "clips/x/b.mp4"}] * 8
    _jsonl(repo / "rl.jsonl", rows)
    dataset = {
        "name": "nvidia/Cosmos-Reason1-RL-Dataset",
        "subset": "robovqa",
        "split": "rl",
        "local_dir": str(repo),
    }
    cfg = _reason_rl(tmp_path, dataset, max_num_steps=2)
    clips = cosmos_clips_dir(cfg.grpo.dataset)
    assert clips == tmp_path / "cache/datasets/nvidia/Cosmos-Reason1-RL-Dataset/robovqa/video_clips"
    train, report = rl_dataset(cfg)
    assert report.num_bad == 0 and (clips / ".prepared").exists()
    assert train[0]["qa_pairs"][1]["content"][0]["image"] == str(clips / "frames" / "r.png")
    assert train[-1]["qa_pairs"][1]["content"][0] == {
        "type": "video",
        "video": str(clips / "frames" / "b.mp4"),
        "fps": 1.0,
        "max_pixels": 81920,
    }
    (repo / "robovqa" / "clips" / "part0.tar.gz").unlink()  # prepared: not read again
    assert rl_dataset(cfg)[1].num_bad == 0

    run = local.run(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_sequences"] == 8 and r["response_length_mean"] > 0 for r in records)


def test_llava_json_becomes_conversations_with_their_images_and_sft_trains(tmp_path):
    """LLaVA's annotation file (one JSON array; `image` a name in one row, a list in another):
    `from`/`value` turns as chat messages, one image item per `<image>` tag where the tag was,
    tags out of the text, a row without media kept as text, a bad turn counted; SFT of the tiny
    Qwen3-VL trains on them with the images' pad tokens never labelled."""
    from nebula_rl import local
    from nebula_rl.data.vision import VisionProcessor

    media = tmp_path / "train2017"
    _png(media / "1.png", (255, 0, 0))
    _png(media / "2.png", (0, 0, 255))
    rows = [
        {
            "image": "1.png",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat colour is it?"},
                {"from": "gpt", "value": "Red."},
            ],
        },
        {
            "image": ["1.png", "2.png"],
            "conversations": [
                {"from": "human", "value": "Look: <image>"},
                {"from": "gpt", "value": "A red one."},
                {"from": "human", "value": "And <image>?"},
                {"from": "gpt", "value": "Blue."},
            ],
        },
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        {"conversations": [{"from": "robot", "value": "?"}]},
    ]
    annotations = tmp_path / "annotations.json"
    annotations.write_text(json.dumps(rows * 4))
    cfg = config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path / "out"),
                "train_batch_per_replica": 4,
                "max_num_steps": 2,
                "train_policy": {
                    "type": "sft",
                    "dataset": {"name": str(annotations), "media_dir": str(media)},
                },
            },
            "policy": {"model_name_or_path": "tiny:qwen3_vl", "model_max_length": 192},
        }
    )
    read = sft_rows(cfg.train.train_policy.dataset, "conversations", key="dataset", seed=0)
    good, report = validate_rows(read, columns=["conversations"])
    assert report.num_bad == 4 and "robot" in next(iter(report.reasons))
    first, second, text = (r["conversations"] for r in good[:3])
    assert first[0] == {
        "role": "user",
        "content": [
            {"type": "image", "image": str(media / "1.png")},
            {"type": "text", "text": "What colour is it?"},
        ],
    }
    assert first[1] == {"role": "assistant", "content": "Red."}
    assert [[i.get("image") for i in m["content"][:-1]] for m in second if m["role"] == "user"] == [
        [str(media / "1.png")],
        [str(media / "2.png")],
    ]
    assert second[2]["content"][-1] == {"type": "text", "text": "And ?"}
    assert text == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]

    processor = VisionProcessor.from_pretrained("tiny:qwen3_vl")
    inputs, mask = processor.sft_example(second)
    pads = {processor.layout.image_token_id}
    assert sum(t in pads for t in inputs.input_ids) > 0
    assert not any(m and t in pads for t, m in zip(inputs.input_ids, mask, strict=True))

    run = local.run(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"audio": {"fps": 1}}, "media kind 'audio'"),
        ({"video": {"fsp": 1}}, r"unknown vision setting\(s\) \['fsp'\]"),
    ],
)
def test_media_settings_are_checked_by_name(settings, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({"train": {"train_policy": {"dataset": {"media_settings": settings}}}})
