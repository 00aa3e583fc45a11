"""Prompt datasets of world-model RL: captions without clips, embedded online by the model's
text encoder (:mod:`nebula_rl.flow.text_encoder`).

`dataset.name` names one of cosmos-rl's diffusion prompt sets (:data:`PROMPT_SETS`: `pickscore`,
`ocr`, `geneval`, `dance_grpo_t2v`; `dataset.split` picks `train` or `test`), fetched on first
use from where cosmos-rl fetches it into nebula-rl's cache (`$NEBULA_RL_CACHE`, else
`~/.cache/nebula_rl`, under `prompt_sets/<name>/`), or a local prompt file:

- `.txt`: one prompt per line (blank lines skipped);
- `.jsonl`: one JSON object per line, its `"prompt"`;
- `.json`: a list of objects, each's `"prompt"` (cosmos-rl's diffusers validation file,
  `validation.dataset.local_dir`).

Each prompt becomes an entry without files (:func:`~nebula_rl.flow.clips.prompt_entries`), and
a clip without video or embeddings (:func:`~nebula_rl.flow.data.prompt_clips`), carrying the
shape its samples take. With no clips, a prompt dataset trains FlowGRPO and DiffusionNFT;
what needs the data (SFT, DDRL's data term, conditioning frames, the distance to the data) is
refused or left out.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

__all__ = [
    "PROMPT_FILE_SUFFIXES",
    "PROMPT_SETS",
    "fetch_prompt_set",
    "is_prompt_dataset",
    "read_prompt_file",
    "read_prompts",
]

_NFT = "https://raw.githubusercontent.com/NVlabs/DiffusionNFT/refs/heads/main/dataset"
PROMPT_SETS: dict[str, dict[str, str]] = {
    "pickscore": {"train": f"{_NFT}/pickscore/train.txt", "test": f"{_NFT}/pickscore/test.txt"},
    "ocr": {"train": f"{_NFT}/ocr/train.txt", "test": f"{_NFT}/ocr/test.txt"},
    "geneval": {
        "train": f"{_NFT}/geneval/train_metadata.jsonl",
        "test": f"{_NFT}/geneval/test_metadata.jsonl",
    },
    "dance_grpo_t2v": {  # (one file: the set has no test split)
        "train": "https://raw.githubusercontent.com/XueZeyue/DanceGRPO/refs/heads/main/assets/"
        "video_prompts.txt",
    },
}
"""cosmos-rl's diffusion prompt sets (`cosmos_rl/tools/dataset/diffusion_nft.py`) by split, at
the addresses it downloads them from."""

PROMPT_FILE_SUFFIXES = (".txt", ".jsonl", ".json")


def is_prompt_dataset(name: str) -> bool:
    """Whether a `dataset.name` is a prompt set or a prompt file (not a clip folder)."""
    return name in PROMPT_SETS or (
        Path(name).suffix in PROMPT_FILE_SUFFIXES and Path(name).is_file()
    )


def _cache_dir() -> Path:
    return Path(os.environ.get("NEBULA_RL_CACHE") or Path.home() / ".cache" / "nebula_rl")


def fetch_prompt_set(name: str, split: str, *, key: str, url: str | None = None) -> Path:
    """The local file of prompt set `name`'s `split`, downloaded into the cache when it is not
    there yet (from `url`, default the set's address); `key` names the config key in errors."""
    splits = PROMPT_SETS[name]
    if split not in splits:
        raise ValueError(
            f"{key}: prompt set {name!r} has the split(s) {', '.join(splits)}, not {split!r} "
            "(dataset.split)"
        )
    url = url or splits[split]
    path = _cache_dir() / "prompt_sets" / name / url.rsplit("/", 1)[1]
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f"{path.suffix}.{os.getpid()}.part")  # (ranks may fetch at once)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            partial.write_bytes(response.read())
    except (urllib.error.URLError, OSError) as err:
        partial.unlink(missing_ok=True)
        raise ValueError(
            f"{key}: could not fetch prompt set {name!r} ({split}) from {url}: {err}; put the file "
            f"at {path}, or name a local prompt file"
        ) from err
    partial.replace(path)
    return path


def read_prompt_file(path: Path, *, key: str) -> list[str]:
    """The prompts of a `.txt`, `.jsonl` or `.json` prompt file, in file order."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        try:
            if path.suffix == ".jsonl":
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                rows = json.loads(text)
                if not isinstance(rows, list):
                    raise ValueError("not a list of objects")
            prompts = [str(row["prompt"]).strip() for row in rows]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f'{key}: {path}: each entry must be an object with a "prompt" ({err})'
            ) from err
    if not prompts:
        raise ValueError(f"{key}: {path} holds no prompt")
    return prompts


def read_prompts(name: str, split: str, *, key: str) -> list[str]:
    """The prompts of prompt set `name`'s `split` (fetched on first use) or of prompt file
    `name`, in file order."""
    path = fetch_prompt_set(name, split, key=key) if name in PROMPT_SETS else Path(name)
    return read_prompt_file(path, key=key)
