"""Vision-language inputs (`data/vision.py`) and the tiny Qwen-VL presets: real transformers models
and image processor, images built in the test, served over a real local HTTP server."""

import base64
import http.server
import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from nebula_rl.data.vision import VisionProcessor, collate, smart_resize
from nebula_rl.models import (
    CHATML_TEMPLATE,
    VISION_TOKENS,
    build_char_tokenizer,
    count_parameters,
    is_vision_language,
    load_model,
)

PRESETS = ["tiny:qwen3_vl", "tiny:qwen2_5_vl", "tiny:cosmos3_omni", "tiny:cosmos3_edge"]


def _image(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8))


def _ask(*items, text: str = "How many squares?") -> list[dict]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=PRESETS)
def vlm(request):
    model = load_model(request.param, seed=1)
    return request.param, model, VisionProcessor.from_pretrained(request.param)


def _batch(processor: VisionProcessor, samples, tok):
    config = processor.layout
    batch = collate(
        samples,
        pad_token_id=tok.pad_token_id,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
    )
    if config.model_type != "qwen2_5_vl":
        batch.pop("second_per_grid_ts", None)  # (Qwen3-VL: time comes from text timestamps)
    return batch


def test_the_tokenizer_keeps_its_ids_and_gains_the_vision_markers(tok):
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    assert ids == list(range(4 + 256, 4 + 256 + 4))  # after every older token
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    assert tok.encode(text) == ids[:1] + ids[2:3] + ids[1:2]  # one token each
    # String content renders as the text-only template always did.
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    listed = _ask({"type": "image", "image": "a.png"}, {"type": "video", "video": ["b.png"]})
    rendered = tok.apply_chat_template(listed, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>How many squares?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.chat_template == CHATML_TEMPLATE


def test_presets_build_and_reload_with_the_auto_class(vlm, tok, tmp_path):
    _, model, processor = vlm
    assert is_vision_language(model.config)
    assert 500_000 < count_parameters(model) < 5_000_000
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    again = AutoModelForImageTextToText.from_pretrained(tmp_path)
    loaded = VisionProcessor.from_pretrained(str(tmp_path))
    sample = _ask({"type": "image", "image": _image(0)})
    ours, theirs = processor(sample), loaded(sample)
    assert ours.input_ids == theirs.input_ids
    assert torch.equal(ours.pixel_values, theirs.pixel_values)
    batch = _batch(processor, [ours], tok)
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, model(**batch).logits)


def _image_only_processor(family: str):
    """transformers' own processor class of `family` (what `AutoProcessor` builds for it),
    taking the image processor and tokenizer only: its video processor needs torchvision, and
    no CPU torchvision build for torch 2.13 installs here (the PyPI wheel links CUDA libraries)."""
    from transformers.models.cosmos3_edge.processing_cosmos3_edge import Cosmos3EdgeProcessor
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    # (Cosmos 3's reasoner ships Qwen3-VL's processor: transformers maps its image processor
    # to Qwen2-VL's and its video processor to Qwen3-VL's; Cosmos 3 Edge has its own)
    base = {"qwen3_vl": Qwen3VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor,
            "cosmos3_omni": Qwen3VLProcessor, "cosmos3_edge": Cosmos3EdgeProcessor}[family]  # fmt: skip

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnly


def test_image_prompts_match_the_transformers_processor(vlm, tok):
    """Our packer against the transformers processor class of each family, on a conversation
    with two images of other sizes than the patch grid (so both resize): the same token ids
    (pads expanded per image), `mm_token_type_ids`, pixel rows and grids."""
    _, _, processor = vlm
    theirs = _image_only_processor(processor.layout.model_type)(
        image_processor=processor.image_processor, tokenizer=tok
    )
    images = [_image(3, (70, 45)), _image(4, (33, 100))]
    chat = _ask(*({"type": "image", "image": im} for im in images))
    ours = processor(chat, add_generation_prompt=True)
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    want = theirs(text=[text], images=images, return_tensors="pt")
    assert ours.input_ids == want["input_ids"][0].tolist()
    assert torch.equal(ours.pixel_values, want["pixel_values"])
    assert torch.equal(ours.image_grid_thw, want["image_grid_thw"])
    batch = _batch(processor, [ours], tok)
    # (Cosmos 3 Edge's processor returns no types without its video processor: image tokens 1)
    image_id = processor.layout.image_token_id
    types = want.get("mm_token_type_ids", (want["input_ids"] == image_id).long())
    assert torch.equal(batch["mm_token_type_ids"], types)


def test_media_expand_to_their_tokens_and_a_mixed_batch_trains(vlm, tok):
    """An image, a video (as frames) and a text-only sample in one batch: each pad run is as
    long as its grid says, `mm_token_type_ids` marks them, and the forward (which checks that
    the vision features fill the pads exactly) trains both the vision tower and the LM."""
    _, model, processor = vlm
    merge, tp = processor.layout.merge_size, processor.layout.temporal_patch_size
    with_image = processor(
        _ask(
            {"type": "image", "image": _image(0)}, {"type": "image", "image": _image(1, (96, 64))}
        ),
        completion_ids=tok.encode("2<|im_end|>"),
    )
    text_only = processor([{"role": "user", "content": "plain text"}], add_generation_prompt=True)
    frames = [_image(10 + i) for i in range(4)]
    with_video = processor(_ask({"type": "video", "video": frames, "fps": 2}))
    assert text_only.pixel_values is None and text_only.image_grid_thw is None
    image_id, video_id = processor.layout.image_token_id, processor.layout.video_token_id
    assert with_image.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6]]
    assert with_image.input_ids.count(image_id) == (16 + 24) // merge**2
    assert with_video.video_grid_thw.tolist() == [[4 // tp, 4, 4]]
    assert with_video.input_ids.count(video_id) == 4 // tp * 16 // merge**2
    assert with_image.pixel_values.shape[0] == 16 + 24  # one row per patch
    batch = _batch(processor, [with_image, text_only, with_video], tok)
    types = batch["mm_token_type_ids"]
    assert int((types == 1).sum()) == 10 and int((types == 2).sum()) == 4 // tp * 4
    assert batch["pixel_values"].shape[0] == 40 and batch["image_grid_thw"].shape == (2, 3)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.zero_grad()
    loss = model(**batch, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    vision = [
        p.grad for n, p in model.named_parameters() if ".visual." in n or n.startswith("visual")
    ]
    assert vision and all(g is not None for g in vision)
    assert sum(float(g.abs().sum()) for g in vision) > 0
    # A sample's logits do not depend on what else is in the batch.
    alone = _batch(processor, [with_video], tok)
    with torch.no_grad():
        together = model(**batch).logits[2, : len(with_video.input_ids)]
        torch.testing.assert_close(model(**alone).logits[0], together, atol=1e-5, rtol=1e-5)


def test_video_patches_follow_the_image_processors_layout(vlm):
    """A still video (a temporal patch of identical frames: two, Cosmos 3 Edge's one) is one
    temporal patch of the image: the same patches as the image processor cuts from that image
    (which repeats it in time)."""
    _, _, processor = vlm
    tp = processor.layout.temporal_patch_size
    image = _image(3)
    as_image = processor(_ask({"type": "image", "image": image}))
    as_video = processor(_ask({"type": "video", "video": [image] * tp}))
    assert as_video.video_grid_thw.tolist() == as_image.image_grid_thw.tolist()
    torch.testing.assert_close(
        as_video.pixel_values_videos, as_image.pixel_values, atol=1e-6, rtol=0
    )
    # Frames that do not fill the last temporal patch are padded with the last one.
    more = processor(_ask({"type": "video", "video": [image] * (tp + 1)}))
    assert more.video_grid_thw.tolist() == [[2, 4, 4]]


def test_qwen3_vl_writes_a_timestamp_before_each_temporal_patch(tok):
    processor = VisionProcessor.from_pretrained("tiny:qwen3_vl")
    frames = [_image(i) for i in range(4)]
    text = tok.decode(processor(_ask({"type": "video", "video": frames, "fps": 2})).input_ids)
    block = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    # Frames 0-1 and 2-3 at 2 fps: the mean times 0.25 s and 1.25 s.
    assert f"<0.2 seconds>{block}<1.2 seconds>{block}How many squares?" in text
    qwen25 = VisionProcessor.from_pretrained("tiny:qwen2_5_vl")
    sample = qwen25(_ask({"type": "video", "video": frames, "fps": 2}))
    assert "seconds" not in tok.decode(sample.input_ids)
    assert sample.second_per_grid_ts == [1.0]  # 2 frames per temporal patch at 2 fps


class _Files(http.server.BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args):
        pass


def test_image_sources_decode_alike(tmp_path):
    """A PIL image, its PNG by path, `file://` URL, `data:` URI, bare base64, raw bytes and an
    HTTP URL give the same inputs."""
    processor = VisionProcessor.from_pretrained("tiny:qwen3_vl")
    image = _image(5, (80, 48))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    png = buffer.getvalue()
    path = tmp_path / "squares.png"
    path.write_bytes(png)
    encoded = base64.b64encode(png).decode()
    _Files.payload = png
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/squares.png"
        sources = [image, str(path), f"file://{path}", f"data:image/png;base64,{encoded}",
                   encoded, png, url]  # fmt: skip
        outputs = [processor(_ask({"type": "image", "image": s})) for s in sources]
    finally:
        server.shutdown()
    for out in outputs[1:]:
        assert out.input_ids == outputs[0].input_ids
        assert torch.equal(out.pixel_values, outputs[0].pixel_values)
    with pytest.raises(FileNotFoundError, match="no such file"):
        processor(_ask({"type": "image", "image": str(tmp_path / "missing.png")}))


def test_per_item_pixel_settings(tok):
    processor = VisionProcessor.from_pretrained("tiny:qwen3_vl")
    image = _image(6, (256, 128))  # 8 x 4 language tokens of 32 px at full size

    def grid(**options):
        out = processor(_ask({"type": "image", "image": image, **options}))
        return out.image_grid_thw.tolist()[0]

    assert grid() == [1, 8, 16]
    small = grid(max_pixels=16 * 32 * 32)  # at most 16 language tokens
    assert small[1] * small[2] // 4 <= 16 and 1.5 <= small[2] / small[1] <= 3
    assert grid(resized_height=64, resized_width=96) == [1, 4, 6]
    big = grid(min_pixels=256 * 32 * 32, max_pixels=1024 * 32 * 32)
    assert big[1] * big[2] // 4 >= 256
    # smart_resize: multiples of the factor, within the bounds, the aspect ratio kept roughly.
    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w = (int(x) for x in rng.integers(8, 2000, size=2))
        if max(h, w) / min(h, w) > 50:
            continue
        rh, rw = smart_resize(h, w, factor=32, min_pixels=4 * 1024, max_pixels=256 * 1024)
        assert rh % 32 == 0 and rw % 32 == 0
        assert 4 * 1024 <= rh * rw <= 256 * 1024 or min(rh, rw) == 32
        assert abs(np.log((rh / rw) / (h / w))) < 0.7
    with pytest.raises(ValueError, match="too elongated"):
        smart_resize(10, 5000, factor=32, min_pixels=1024, max_pixels=1 << 20)


def test_video_frame_settings():
    processor = VisionProcessor.from_pretrained("tiny:qwen2_5_vl")
    frames = [_image(i) for i in range(10)]
    kept = processor(_ask({"type": "video", "video": frames, "fps": 2, "nframes": 4}))
    assert kept.video_grid_thw.tolist()[0][0] == 2  # 4 frames, 2 per temporal patch
    assert kept.second_per_grid_ts == [pytest.approx(2 / (2 * 4 / 10))]  # sampled at 0.8 fps
    large = [_image(i, (224, 224)) for i in range(2)]  # 8 x 8 tokens of 28 px each
    full = processor(_ask({"type": "video", "video": large}))
    assert full.video_grid_thw.tolist() == [[1, 16, 16]]
    budget = processor(_ask({"type": "video", "video": large, "total_pixels": 16 * 28 * 28}))
    assert budget.video_grid_thw.tolist() == [[1, 8, 8]]  # 16 tokens for the two frames


def test_video_files_decode_with_pyav_at_the_asked_rate(tmp_path):
    """An MP4 file of 8 frames at 4 fps asked for at `fps = 2`: every second frame, the same
    patches as those frames given as a list, and the clip's time per temporal patch."""
    import av

    path = tmp_path / "clip.mp4"
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)] * 2
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width = stream.height = 56
        stream.pix_fmt = "yuv420p"
        for colour in colours:
            frame = av.VideoFrame.from_image(Image.new("RGB", (56, 56), colour))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(str(path)) as container:
        decoded = [f.to_image() for f in container.decode(container.streams.video[0])]
    assert len(decoded) == 8
    kept = decoded[::2]
    red = np.asarray(kept[0], dtype=float).mean(axis=(0, 1))
    assert red[0] > 200 and red[1] < 60 and red[2] < 60  # the first frame, through the codec

    processor = VisionProcessor.from_pretrained("tiny:qwen2_5_vl")
    from_file = processor(_ask({"type": "video", "video": str(path), "fps": 2}))
    from_frames = processor(_ask({"type": "video", "video": kept, "fps": 2}))
    assert from_file.video_grid_thw.tolist() == [[2, 4, 4]]  # 4 frames, 2 per temporal patch
    assert torch.equal(from_file.pixel_values_videos, from_frames.pixel_values_videos)
    assert from_file.input_ids == from_frames.input_ids
    assert from_file.second_per_grid_ts == [pytest.approx(1.0)]  # 2 frames at 2 fps


def test_sft_labels_cover_the_assistant_and_never_media(tok):
    """Assistant tokens (and their end-of-turn) are trained, nothing else: not the user's text,
    not the image's tokens, even in a second user turn after an answer."""
    processor = VisionProcessor.from_pretrained("tiny:qwen3_vl")
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": _image(0)},
                                     {"type": "text", "text": "How many squares?"}]},
        {"role": "assistant", "content": "<answer>3</answer>"},
        {"role": "user", "content": [{"type": "image", "image": _image(1, (96, 64))},
                                     {"type": "text", "text": "And here?"}]},
        {"role": "assistant", "content": "<answer>1</answer>"},
    ]  # fmt: skip
    inputs, mask = processor.sft_example(conversation, system_prompt="Count.")
    ids = inputs.input_ids
    assert len(mask) == len(ids)
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "<answer>3</answer><|im_end|>\n<answer>1</answer><|im_end|>\n"
    image_id = processor.layout.image_token_id
    assert ids.count(image_id) == 4 + 6
    assert not any(m for t, m in zip(ids, mask, strict=True) if t == image_id)
    assert inputs.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6]]
    assert tok.decode(ids).startswith("<|im_start|>system\nCount.<|im_end|>")
    # The same prompt as generation sees it is a prefix of the SFT ids.
    prompt = processor(conversation[:1], add_generation_prompt=True, completion_ids=[])
    start = ids.index(tok.convert_tokens_to_ids("<|im_start|>"), 1)  # (after the system turn)
    assert ids[start : start + len(prompt.input_ids)] == prompt.input_ids
    with pytest.raises(ValueError, match="model_max_length = 20"):
        processor.sft_example(conversation, max_length=20)


def _squares_sft(tmp_path, model: str = "tiny:qwen3_vl", **train_policy):
    from nebula_rl.config import config_from_dict

    return config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "timestamp": "vlm",
                "optm_lr": 2e-3,
                "optm_warmup_steps": 2,
                "optm_weight_decay": 0.0,
                "train_batch_per_replica": 8,
                "max_num_steps": 14,
                "seed": 3,
                "train_policy": {
                    "type": "sft",
                    "mini_batch": 8,
                    "dataset": {
                        "name": "builtin:squares",
                        "test_size": 16,
                        "kwargs": {"num_samples": 160, "seed": 5},
                    },
                    **train_policy,
                },
            },
            "policy": {
                "model_name_or_path": model,
                "model_max_length": 128,
                "freeze_pattern": [r"^model\.visual\."],
            },
            "validation": {"enable": True, "freq": 7, "val_before_train": True},
        }
    )


@pytest.mark.parametrize(
    ("model", "cls"),
    [
        ("tiny:qwen3_vl", "Qwen3VLForConditionalGeneration"),
        ("tiny:cosmos3_omni", "Cosmos3OmniForConditionalGeneration"),
    ],
    ids=["qwen3_vl", "cosmos3_omni"],
)
def test_sft_of_a_vision_language_model_trains_and_exports(tmp_path, model, cls):
    """`nebula-rl train`'s SFT loop on image conversations (the built-in squares task), of
    Qwen3-VL and of Cosmos 3's reasoner: the validation loss falls, the frozen vision tower keeps
    its weights while the language model's change, and the export loads with its class's
    `from_pretrained` (and the auto class) and its processor."""
    import json

    import transformers

    from nebula_rl import local
    from nebula_rl.data import squares_task

    run_dir = local.run(_squares_sft(tmp_path, model))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 3 and val[-1] < 0.5 * val[0], val
    export = run_dir / "safetensors" / "final"
    trained = getattr(transformers, cls).from_pretrained(export)
    assert type(AutoModelForImageTextToText.from_pretrained(export)) is type(trained)
    initial = load_model(model, seed=3)
    before = dict(initial.named_parameters())
    changed = {n: not torch.equal(p, before[n]) for n, p in trained.named_parameters()}
    assert not any(v for n, v in changed.items() if n.startswith("model.visual."))
    assert all(v for n, v in changed.items() if ".language_model.layers." in n)
    processor = VisionProcessor.from_pretrained(str(export))
    sample = processor(squares_task(num_samples=1)[0]["prompt"], add_generation_prompt=True)
    batch = _batch(processor, [sample], processor.tokenizer)
    with torch.no_grad():
        assert torch.isfinite(trained(**batch).logits).all()


def squares_grpo(tmp_path, model: str = "tiny:qwen3_vl", **train):
    """Two GRPO steps in one process on the counting task's images (8 completions a step, the
    Cosmos-Reason recipe's rewards), of `model`, with `train`'s extra `[train]` keys."""
    from nebula_rl.config import config_from_dict

    return config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "max_num_steps": 2,
                "train_batch_per_replica": 8,
                **train,
                "train_policy": {
                    "type": "grpo",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "reward_function": ["single_choice", "format"],
                    "dataset": {"name": "builtin:squares", "kwargs": {"num_samples": 16}},
                },
            },
            "policy": {"model_name_or_path": model, "model_max_length": 96},
            "rollout": {
                "backend": "torch",
                "n_generation": 4,
                "batch_size": 2,
                "max_response_length": 8,
            },
        }
    )


def test_vision_language_packing_is_refused_and_grpo_runs_on_images(tmp_path):
    """Packing conversations with media is refused by name; GRPO in one process generates from
    the images, trains on them and exports a model that loads with its processor."""
    import json

    from transformers import AutoModelForImageTextToText

    from nebula_rl import local

    with pytest.raises(ValueError, match=r"train\.sequence_packing is not supported for conv"):
        cfg = _squares_sft(tmp_path)
        cfg.train.sequence_packing = True
        local.run(cfg)
    run = local.run(squares_grpo(tmp_path))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_sequences"] == 8 and r["response_length_mean"] > 0 for r in records)
    export = run / "safetensors" / "final"
    assert (export / "preprocessor_config.json").is_file()
    assert AutoModelForImageTextToText.from_pretrained(export).config.model_type == "qwen3_vl"


@pytest.mark.slow
@pytest.mark.early
def test_the_vlm_demo_sft_config_learns_to_count(vlm_demo_sft):
    """`configs/vlm_demo_sft.toml` as shipped (one process, ~2 minutes; run once for the
    session, conftest.py): its export reads the count off held-out images, where a model that
    ignored them would score ~0.25."""
    from nebula_rl.data import squares_task

    export = vlm_demo_sft / "safetensors" / "final"
    model = AutoModelForImageTextToText.from_pretrained(export).eval()
    processor = VisionProcessor.from_pretrained(str(export))
    tok = processor.tokenizer
    think = tok.encode("<think>")
    rows = squares_task(num_samples=100, seed=99)  # (the training rows are seed 7's)
    correct = 0
    with torch.no_grad():
        for row in rows:
            prompt = processor(row["prompt"], add_generation_prompt=True, completion_ids=think)
            logits = model(**_batch(processor, [prompt], tok)).logits[0, -1]
            correct += tok.decode([int(logits.argmax())]) == row["answer"]
    assert correct >= 90, correct


@pytest.mark.slow
@pytest.mark.early
def test_vlm_demo_learns_to_count_with_grpo(tmp_path, vlm_demo_sft):
    """`configs/vlm_demo.toml` (`make vlm-demo`: a tiny Qwen3-VL, rewards single_choice +
    format on images) from its SFT warm start (the SFT demo run above at step 300, which is
    what vlm_demo_warmstart.toml trains: conftest.py), its 200 steps in one process
    (`--local`, ~5 min where the shipped layout, rollout TP 2 and policy FSDP 2, took ~11 on 2
    cores). That layout's steps and pushes equal one process's (tests/test_vision_rl.py:
    two-rank GRPO steps like one process, TP 2 policy -> TP 2 rollout pushes), so this run's
    learning is the layout's. It learns when the least-squares slope of the steps' mean reward
    (0..2) is at least 0.0006 a step: measured 0.00124 (first 20 steps 1.32, last 20 1.54),
    with a standard error of 0.00012 from the steps' noise. (The difference of the first and
    last 20 steps' means, +0.22 in that run against a bound of 0.2, was too close to call.)"""
    from conftest import least_squares_slope, solo_threads
    from nebula_rl.config import load_config
    from test_recipes import ROOT, _job

    cfg = load_config(ROOT / "configs" / "vlm_demo.toml")
    assert cfg.policy.parallelism.dp_shard_size == 2 and cfg.rollout.parallelism.tp_size == 2
    assert cfg.policy.warmstart_config == "configs/vlm_demo_warmstart.toml"
    cfg.policy.parallelism.dp_shard_size = cfg.rollout.parallelism.tp_size = 1  # (one process)
    warm = vlm_demo_sft / "safetensors" / "step_300"
    steps = _job(tmp_path / "rl", cfg, warm, "--local", threads=solo_threads())
    rewards = [r["reward_mean"] for r in steps]
    assert len(rewards) == 200
    assert least_squares_slope(rewards) >= 0.0006, rewards


def _squares_config(tmp_path, name: str, dataset: dict | None = None, **parallelism: int):
    from nebula_rl.config import config_from_dict

    dp = parallelism.get("dp_shard_size", 1) * parallelism.get("dp_replicate_size", 1)
    cfg = config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "timestamp": name,
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "train_batch_per_replica": 8 // dp,
                "max_num_steps": 3,
                "seed": 5,
                "train_policy": {
                    "type": "sft",
                    "mini_batch": 4,
                    "dataset": dataset
                    or {"name": "builtin:squares", "kwargs": {"num_samples": 48}},
                },
            },
            "policy": {
                "model_name_or_path": "tiny:qwen3_vl",
                "model_max_length": 128,
                "parallelism": parallelism,
            },
        }
    )
    path = tmp_path / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return path


_FOUR_RANKS = [
    pytest.param({"tp_size": 2, axis: 2}, id=f"tp-{axis}", marks=pytest.mark.slow)
    for axis in ("dp_shard_size", "dp_replicate_size")
]


# (two ranks: the next test, with images, videos and text)
@pytest.mark.parametrize("layout", _FOUR_RANKS)
def test_multi_rank_sft_of_a_vision_language_model_steps_like_one_process(tmp_path, layout):
    """`nebula-rl train` with `tp_size = 2` and two FSDP2 or DDP ranks (4 ranks): FSDP2 or DDP
    splits the rows, the language model is split by heads and columns, and the tower is sharded
    over the TP and FSDP ranks. Each way the losses, gradient norms and exported weights are one
    process's."""
    from sft_runs import assert_two_like_one, train

    for name, parallelism in (("one", {}), ("two", layout)):
        train(_squares_config(tmp_path, name, **parallelism))
    weights = assert_two_like_one(tmp_path, 3, atol=1e-5)
    assert any(k.startswith("model.visual.") for k in weights)


@pytest.mark.parametrize(
    "split",
    # (TP in the slow suite: test_vision_rl steps a vision-language model under TP fast)
    ["dp_shard_size", pytest.param("tp_size", marks=pytest.mark.slow)],
)
def test_two_rank_sft_with_images_videos_and_text_steps_like_one_process(tmp_path, split):
    """`nebula-rl train` with two ranks, on rows with an image, with a video (two frames) or text
    only. FSDP2 (`dp_shard_size = 2`) shards the vision blocks and the decoder layers and each
    rank trains half of every batch: in a seeded order that gives the two ranks passes with
    different kinds of media, every rank still runs the vision tower on images and then on
    videos (blank ones where its rows have none), so FSDP's collectives pair up. TP
    (`tp_size = 2`) splits the language model by heads and columns (sequence parallel between its
    layers, DeepStack features added where the sequence is whole), the tower FSDP2-sharded over
    the two ranks, which run the same rows; passes without images or videos leave the tower
    alone on both ranks. Either way the job steps like one process."""
    import json

    from nebula_rl.data import squares_task
    from sft_runs import assert_two_like_one, train

    rows = []
    for i, row in enumerate(squares_task(num_samples=48, seed=7)):
        user, reply = row["conversations"]
        image = user["content"][0]["image"]
        if i % 3 == 1:  # a video of the image twice
            user["content"][0] = {"type": "video", "video": [image, image], "fps": 1}
        elif i % 3 == 2:
            user = {"role": "user", "content": "How many squares?"}
        rows.append({"conversations": [user, reply]})
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, parallelism in (("one", {}), ("two", {split: 2})):
        train(_squares_config(tmp_path, name, {"name": str(data)}, **parallelism))
    assert_two_like_one(tmp_path, 3, atol=1e-5)


@pytest.mark.parametrize("split", ["pp_size", "cp_size"])
def test_pipeline_and_context_parallel_layouts_of_a_vision_language_model_are_refused(split):
    from nebula_rl.models import load_model_config
    from nebula_rl.policy.parallelize import ParallelDims

    sizes = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, split[:2]: 2}
    with pytest.raises(ValueError, match=rf"{split} > 1: a vision-language model \(qwen3_vl\)"):
        ParallelDims(**sizes).check_model(load_model_config("tiny:qwen3_vl"))
    for fine in ("dp_shard", "tp"):
        ParallelDims(**{**sizes, split[:2]: 1, fine: 2}).check_model(
            load_model_config("tiny:qwen3_vl")
        )
