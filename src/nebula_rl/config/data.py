"""`[train.train_policy.dataset]` and `[validation.dataset]`: where prompts and samples come from."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    field_validator,
)

from nebula_rl.config.base import Section

VISION_OPTIONS = frozenset(
    {
        "min_pixels",
        "max_pixels",
        "resized_height",
        "resized_width",
        "fps",
        "nframes",
        "min_frames",
        "max_frames",
        "total_pixels",
    }
)
"""The per-item vision settings a content item may carry (see `nebula_rl.data.vision`)."""


class DatasetConfig(Section):
    """Where a dataset comes from: a Hugging Face Hub dataset, a local file or folder,
    WebDataset shards, or a built-in task."""

    name: str = ""
    """A Hub dataset id (`openai/gsm8k`, fetched with `datasets` into the usual cache), a local
    JSONL/JSON/Parquet/CSV file, a folder of such files or a saved `datasets` folder,
    WebDataset tar shards (`s3://bucket/prefix/`, `s3://bucket/train-{0000..0031}.tar`, a local
    `.tar`, pattern or folder of them; docs/storage.md), or `builtin:<task>` for a procedurally
    generated task (e.g. `builtin:arithmetic`)."""
    subset: str = ""
    """Hub dataset configuration name (e.g. `main` for openai/gsm8k); "" for the default."""
    revision: str = ""
    """Hub dataset revision: a branch, tag or commit hash; "" for the default branch."""
    split: str | list[str] = Field(default_factory=lambda: ["train"])
    """Split(s) to read, concatenated in order: Hub splits, or for a local folder the files named
    `<split>*.jsonl` / `.parquet` / ...."""
    test_size: float | int | None = None
    """Held-out part for validation: a fraction in (0, 1) or a number of rows; None keeps all."""
    local_dir: str = ""
    """A local folder to read the dataset from instead of the Hub (`name` then only names it)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """nebula-rl: options passed to a built-in task generator (e.g. `max_operand`, `num_samples`)."""
    media_dir: str = ""
    """nebula-rl: the folder where the file names of the rows' `image` / `video` columns are
    found (as paths below it, else by file name anywhere in it); "" for the dataset file's folder,
    or for a Hub dataset cosmos-rl's `$COSMOS_CACHE/datasets/<name>/<subset>/video_clips`, filled
    from the dataset's `<subset>/clips/*.tar.gz` on first use."""
    media_settings: dict[str, dict[str, int | float]] = Field(
        default_factory=lambda: {"video": {"fps": 1.0, "max_pixels": 81920}}
    )
    """nebula-rl: per-item vision settings given to the media of the rows' `image` / `video`
    columns, by kind (default: Cosmos-Reason's videos at 1 frame per second, at most 81920 pixels
    a frame)."""

    @field_validator("split")
    @classmethod
    def _split_as_list(cls, v: str | list[str]) -> list[str]:
        return [v] if isinstance(v, str) else v

    @field_validator("media_settings")
    @classmethod
    def _known_settings(
        cls, v: dict[str, dict[str, int | float]]
    ) -> dict[str, dict[str, int | float]]:
        for kind, settings in v.items():
            if kind not in ("image", "video"):
                raise ValueError(f"media kind {kind!r}: give settings for 'image' or 'video'")
            unknown = sorted(set(settings) - VISION_OPTIONS)
            if unknown:
                raise ValueError(
                    f"{kind}: unknown vision setting(s) {unknown}; choose from "
                    f"{sorted(VISION_OPTIONS)}"
                )
        return v
