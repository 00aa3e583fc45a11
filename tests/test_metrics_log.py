"""Metric sinks: TensorBoard event files read back with tensorboard's own reader, an offline W&B
run read back from its run file, the console's lines and progress bar, and the local loop
feeding them the records of metrics.jsonl."""

from __future__ import annotations

import io
import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nebula_rl.config import Config, ConfigError, config_from_dict
from nebula_rl.utils import metrics_log
from nebula_rl.utils.metrics_log import ConsoleLogger, TensorBoardLogger, open_loggers, wandb_mode

RECORDS = [
    {
        "step": s,
        "policy_version": s,
        "reward_mean": 0.25 * s,
        "loss": -0.01 * s,
        "num_tokens": 100 + s,
        "step_time": 0.5,
        "rollout_tokens_per_s": 1000.0 * s,
        "resumed": False,  # a bool and a string are not scalars: left out
        "note": "text",
    }
    for s in (1, 2, 3)
]
SCALARS = {
    "policy_version",
    "reward_mean",
    "loss",
    "num_tokens",
    "step_time",
    "rollout_tokens_per_s",
}


def _cfg(tmp_path: Path, **logging_section: Any) -> Config:
    return config_from_dict(
        {"train": {"output_dir": str(tmp_path), "timestamp": "run"}, "logging": logging_section}
    )


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_event_files_hold_every_number_logged(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, logger=["tensorboard"])
    with open_loggers(cfg, tmp_path, total_steps=3) as loggers:
        assert [type(s) for s in loggers.sinks] == [TensorBoardLogger]
        for record in RECORDS:
            loggers.log(record)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = _scalars(tmp_path / "tensorboard")
    assert set(scalars) == SCALARS
    for key in SCALARS:
        assert [step for step, _ in scalars[key]] == [1, 2, 3]
        # TensorBoard stores float32
        expected = [float(r[key]) for r in RECORDS]
        assert [v for _, v in scalars[key]] == pytest.approx(expected, rel=1e-6)


def test_tensorboard_resume_purges_the_steps_it_retrains(tmp_path: Path) -> None:
    first = TensorBoardLogger(tmp_path)
    for step in (1, 2, 3, 4):
        first.log({"step": step, "loss": float(step)})
    first.close()
    resumed = TensorBoardLogger(tmp_path)  # resumed from a checkpoint of step 2
    for step in (3, 4):
        resumed.log({"step": step, "loss": 10.0 * step})
    resumed.close()
    assert _scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def _wandb_records(run_file: Path) -> list[Any]:
    """The protobuf records of a W&B run file (a LevelDB-style log: 7-byte file header, then
    32 KiB blocks of chunks, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_holds_the_config_and_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    cfg = _cfg(
        tmp_path, logger=["wandb"], project_name="proj", experiment_name="exp", group_name="grp"
    )
    run_dir = tmp_path / "run"
    with open_loggers(cfg, run_dir, total_steps=3) as loggers:
        for record in RECORDS:
            loggers.log(record)
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, run.run_group) == ("proj", "exp", "grp")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["logging"]["logger"] == ["wandb"]
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in r.history.item
                }
            )
    assert [row["_step"] for row in rows] == [1, 2, 3]
    for row, record in zip(rows, RECORDS, strict=True):
        for key, value in record.items():
            if key != "step":
                assert row[key] == value, key


def test_wandb_mode_is_offline_without_an_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert wandb_mode("auto") == "offline"
    assert wandb_mode("online") == "online"
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    (home / ".netrc").chmod(0o600)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") is None  # wandb reads WANDB_MODE itself
    assert wandb_mode("offline") == "offline"


def test_console_prints_a_line_per_step_and_a_progress_bar(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, force_interactive=True, width=160)
    sink = ConsoleLogger(total_steps=4, window=2, console=console)
    with caplog.at_level(logging.INFO, logger="nebula_rl.utils.metrics_log"):
        for record in RECORDS:
            sink.log(record)
    sink.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("step 1/4  reward 0.250 (recent mean 0.250)  loss -0.0100")
    assert lines[2].startswith("step 3/4  reward 0.750 (recent mean 0.625)")  # last 2 steps
    assert lines[2].endswith("0.50 s/step  3000 tok/s")
    screen = out.getvalue()
    assert "3/4" in screen and "reward 0.625" in screen and "3000 tok/s" in screen
    assert "ETA" in screen


def test_console_prints_a_line_every_log_interval_steps_with_their_means(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, force_interactive=True, width=160)
    sink = ConsoleLogger(total_steps=5, console=console, interval=2)
    records = [{"step": s, "reward_mean": s / 10, "loss": float(s)} for s in range(1, 6)]
    with caplog.at_level(logging.INFO, logger="nebula_rl.utils.metrics_log"):
        for record in records:
            sink.log(record)
    sink.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4  # the first step, steps 2 and 4, and the last
    assert lines[0].startswith("step 1/5  reward 0.100")
    assert lines[1].startswith("step 2/5  reward 0.200") and "means of" not in lines[1]
    assert lines[2].startswith("step 4/5  reward 0.350") and "loss +3.5000" in lines[2]
    assert lines[2].endswith("(means of steps 3-4)")
    assert lines[3].startswith("step 5/5  reward 0.500")
    assert "5/5" in out.getvalue()  # the bar moved at every step


def test_console_without_a_terminal_logs_lines_and_draws_no_bar(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = io.StringIO()
    sink = ConsoleLogger(total_steps=2, console=Console(file=out, force_terminal=False))
    sft = {"step": 1, "loss": 2.5, "val_loss": 2.75, "num_tokens": 300, "step_time": 0.5}
    with caplog.at_level(logging.INFO, logger="nebula_rl.utils.metrics_log"):
        sink.log(sft)
    sink.close()
    assert caplog.records[0].getMessage() == (
        "step 1/2  loss +2.5000  val_loss 2.7500  0.50 s/step  600 tok/s"
    )
    assert out.getvalue() == ""


def test_open_loggers_takes_only_the_sinks_asked_for(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, logger=["Console", "tensorboard"])
    assert cfg.logging.logger == ["console", "tensorboard"]
    with open_loggers(cfg, tmp_path, total_steps=1, only=metrics_log.FILE_LOGGERS) as loggers:
        assert [type(s) for s in loggers.sinks] == [TensorBoardLogger]
    with open_loggers(_cfg(tmp_path), tmp_path, total_steps=1, only={"tensorboard"}) as loggers:
        assert loggers.sinks == []


def test_a_missing_package_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(metrics_log._PACKAGES, "wandb", "nebula_rl_no_such_package")
    with pytest.raises(ValueError, match=r"nebula_rl_no_such_package package is not installed"):
        open_loggers(_cfg(tmp_path, logger=["wandb"]), tmp_path, total_steps=1)
    assert not (tmp_path / "wandb").exists()


def test_logging_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"logging\.logger: .*more than once"):
        _cfg(tmp_path, logger=["console", "console"])
    with pytest.raises(ConfigError, match=r"logging\.logger\.0: "):
        _cfg(tmp_path, logger=["mlflow"])
    with pytest.raises(ConfigError, match=r"logging\.report_mfu = true: nebula-rl computes no MFU"):
        _cfg(tmp_path, report_mfu=True)


def test_local_sft_run_writes_tensorboard_equal_to_metrics_jsonl(tmp_path: Path) -> None:
    from nebula_rl import local

    cfg = config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "timestamp": "sft",
                "train_batch_per_replica": 4,
                "max_num_steps": 3,
                "train_policy": {
                    "type": "sft",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 16}},
                },
                "ckpt": {"export_safetensors": False},
            },
            "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 32},
            "logging": {"logger": ["console", "tensorboard"]},
        }
    )
    run_dir = local.run(cfg)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    scalars = _scalars(run_dir / "tensorboard")
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "num_tokens"):
        assert [v for _, v in scalars[key]] == pytest.approx([r[key] for r in records], rel=1e-6)


def test_console_takes_validation_records_before_and_between_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, force_interactive=True, width=160)
    sink = ConsoleLogger(total_steps=2, console=console)
    with caplog.at_level(logging.INFO, logger="nebula_rl.utils.metrics_log"):
        sink.log({"step": 0, "val/reward_mean": 0.5, "val/rollout_count": 8})
        sink.log({"step": 1, "reward_mean": 0.25, "loss": 0.1})
        sink.log({"step": 1, "val/reward_mean": 0.625})
    sink.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "step 0/2  val reward 0.500"
    assert lines[2] == "step 1/2  val reward 0.625"
    assert "1/2" in out.getvalue()


def test_video_sample_grids_go_out_as_images_and_animations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A world model's samples of 3 frames: the PNG grid (frames side by side) goes to
    TensorBoard and W&B as an image, the animated GIF beside it as `<tag>_video` (TensorBoard
    plays it in its Images tab; a `wandb.Video`), frame t of the GIF showing every sample's
    frame t."""
    import numpy as np
    import torch
    from PIL import Image, ImageSequence

    from nebula_rl.flow.data import frame_grid, save_samples
    from nebula_rl.utils.metrics_log import log_image_file

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    pixels = torch.randint(0, 256, (2, 4, 3, 3, 8, 8), generator=torch.Generator().manual_seed(0))
    pixels = pixels.to(torch.uint8)  # 2 captions x 4 samples of 3 frames of 8 x 8
    png = save_samples(pixels, tmp_path / "samples" / "step_2.png")
    assert sorted(p.name for p in png.parent.iterdir()) == ["step_2.gif", "step_2.png"]
    assert np.array_equal(np.asarray(Image.open(png)), np.asarray(frame_grid(pixels)))
    run_dir = tmp_path / "run"
    cfg = _cfg(tmp_path, logger=["tensorboard", "wandb"])
    with open_loggers(cfg, run_dir, total_steps=2) as loggers:
        loggers.log(RECORDS[0])
        log_image_file(loggers, "samples", 2, png)

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    [image] = events.Images("samples")
    [video] = events.Images("samples_video")
    assert (image.step, image.height, image.width) == (2, 16, 96)
    assert (video.step, video.height, video.width) == (2, 16, 32)
    assert image.encoded_image_string == png.read_bytes()
    gif = Image.open(io.BytesIO(video.encoded_image_string))
    frames = [np.asarray(f.convert("RGB"), dtype=float) for f in ImageSequence.Iterator(gif)]
    assert len(frames) == 3 and gif.info["loop"] == 0
    wanted = [np.asarray(frame_grid(pixels[:, :, :, t : t + 1]), dtype=float) for t in range(3)]
    for t, frame in enumerate(frames):  # (GIF's 256 colours: near its own frame, not others)
        gaps = [np.abs(frame - w).mean() for w in wanted]
        assert gaps[t] < 16 and gaps[t] < 0.5 * min(g for u, g in enumerate(gaps) if u != t)

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in _wandb_records(run_file)
        if r.WhichOneof("record_type") == "history"
    ]
    [row] = [row for row in rows if row["_step"] == 2]
    assert row["samples/_type"] == "image-file"
    assert row["samples_video/_type"] == "video-file"
    [kept] = run_dir.glob(f"wandb/offline-run-*/files/{row['samples_video/path']}")
    assert kept.read_bytes() == png.with_suffix(".gif").read_bytes()
