"""Datasets stored as WebDataset tar shards, on local disk or in S3-compatible object storage.

`dataset.name` names them: `s3://bucket/prefix/` (every `.tar` below it),
`s3://bucket/prefix/train-{000000..000031}.tar` (a brace pattern), or the same locally (a `.tar`
file, a pattern, a folder of `.tar` files). A shard's members are grouped into samples by name,
`<key>.<ext>`, as WebDataset writes them:

- a language or vision-language row is `<key>.json` (the row, as a line of a JSONL file would
  be), with its media beside it (`<key>.jpg`, `.png`, `.webp`, `<key>.mp4`, ...); a row without
  an `image` / `video` column takes the sample's own image or video;
- a world-model clip is cosmos-rl's diffusers layout, `<key>.json` (`{"prompt": ...}`) or
  `<key>.txt` (the caption) with `<key>.mp4` / `.npy` / `.jpg` / `.png`; with a `<key>.pickle`
  (T5 embeddings computed offline) it is cosmos-rl's local layout.

The job's first process (`nebula-rl train`) streams each shard once through the `webdataset`
library's tar reader (an S3 object is read as a stream, never staged whole) and writes the samples
into a cache folder, `$NEBULA_RL_CACHE/shards/<digest of the name>/` (`~/.cache/nebula_rl`
by default; written beside it and renamed when whole: it is complete or absent), in the layout
the local readers take; it is kept, keyed by the name: delete it to read changed shards. From there
the dataset is a local one: rows in shard order, media found by name, sharded over replicas (the
controller hands each prompt to one) and ranks (SFT's data-parallel ranks take disjoint slices of
each epoch's order) without duplication, and positioned on resume exactly as any dataset.

Nothing here imports torch until a folder is unpacked (webdataset imports it): the controller
reads the folder the launcher unpacked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nebula_rl.config import Config

__all__ = ["ROWS", "is_shards", "shard_folder", "shard_urls", "unpack_datasets", "unpacked"]

ROWS = "rows.jsonl"
"""The file of an unpacked folder that holds its `.json` rows, in shard order."""
_IMAGES = ("jpg", "jpeg", "png", "webp")
_VIDEOS = ("mp4", "webm", "mov", "avi")


def is_shards(name: str) -> bool:
    """Whether a dataset name names WebDataset shards (an `s3://` URL, a `.tar` file or pattern,
    or a local folder of `.tar` files)."""
    if name.startswith("s3://") or name.endswith(".tar"):
        return True
    path = Path(name) if name else None
    return path is not None and path.is_dir() and any(path.glob("*.tar"))


def shard_folder(name: str) -> Path:
    """The cache folder the shards `name` unpack into."""
    cache = Path(os.environ.get("NEBULA_RL_CACHE") or Path.home() / ".cache" / "nebula_rl")
    return cache / "shards" / hashlib.sha256(name.encode()).hexdigest()[:16]


def _bucket(url: str) -> tuple[str, str]:
    bucket, _, path = url.removeprefix("s3://").partition("/")
    return bucket, path


def _needs_webdataset(key: str) -> Any:
    """braceexpand (webdataset's dependency), or a ValueError naming `key` when webdataset is
    not installed."""
    try:
        import braceexpand
        import webdataset  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"{key}: reading WebDataset shards needs webdataset (pip install "
            "'nebula-rl[webdataset]'; from S3, 'nebula-rl[webdataset,s3]')"
        ) from err
    return braceexpand


def shard_urls(name: str, *, key: str) -> list[str]:
    """The shards `name` stands for, in order (an `s3://` prefix is listed, so its credentials
    are needed: :class:`~nebula_rl.utils.object_store.ObjectStore`'s)."""
    if "{" in name:
        urls = list(_needs_webdataset(key).braceexpand(name))
    elif name.startswith("s3://") and not name.endswith(".tar"):
        from nebula_rl.utils.object_store import ObjectStore, StorageError

        bucket, prefix = _bucket(name)
        try:
            store = ObjectStore(bucket, key=key)
            store.check()
            keys = store.list_objects(prefix)
        except StorageError as err:
            raise ValueError(f"{key}: {name}: {err}") from err
        urls = [f"s3://{bucket}/{k}" for k in keys if k.endswith(".tar")]
    elif name.endswith(".tar"):
        urls = [name]
    else:
        urls = [str(p) for p in sorted(Path(name).glob("*.tar"))]
    if not urls:
        raise ValueError(f"{key}: {name} holds no .tar shard")
    return urls


def _open(url: str, key: str) -> IO[bytes]:
    if not url.startswith("s3://"):
        if not Path(url).is_file():
            raise ValueError(f"{key}: shard {url} does not exist")
        return open(url, "rb")
    from nebula_rl.utils.object_store import ObjectStore, StorageError

    bucket, path = _bucket(url)
    try:
        return ObjectStore(bucket, key=key).open_object(path)
    except StorageError as err:
        raise ValueError(f"{key}: shard {url}: {err}") from err


def _samples(urls: list[str], key: str) -> Iterator[dict[str, Any]]:
    """The samples of the shards, in order, through webdataset's tar reader."""
    _needs_webdataset(key)
    from webdataset.tariterators import group_by_keys, tar_file_expander

    def streams() -> Iterator[dict[str, Any]]:
        for url in urls:
            with contextlib.closing(_open(url, key)) as stream:
                yield {"url": url, "stream": stream}

    yield from group_by_keys(tar_file_expander(streams()))


def _write(sample: dict[str, Any], root: Path, rows: IO[str], key: str) -> None:
    """One sample into the folder (its members as `<stem>.<ext>`), its row into `rows`."""
    stem = sample["__key__"].replace("/", "_")
    members = {ext: data for ext, data in sample.items() if not ext.startswith("__")}
    where = f"{key}: sample {sample['__key__']!r} of {sample['__url__']}"
    if (root / f"{stem}.json").exists() or (root / "metas" / f"{stem}.txt").exists():
        raise ValueError(f"{where}: another sample has the same name")
    if "pickle" in members:  # (cosmos-rl's local layout: caption, clip, T5 embeddings)
        video = next((e for e in ("mp4", "npy") if e in members), None)
        if "txt" not in members or video is None:
            raise ValueError(f"{where}: a sample with embeddings needs a .txt and an .mp4 / .npy")
        for folder, ext in (("metas", "txt"), ("videos", video), ("t5_xxl", "pickle")):
            (root / folder).mkdir(exist_ok=True)
            (root / folder / f"{stem}.{ext}").write_bytes(members[ext])
        return
    if "json" in members:
        try:
            row = json.loads(members["json"])
        except ValueError as err:
            raise ValueError(f"{where}: its .json is not JSON ({err})") from err
        if not isinstance(row, dict):
            raise ValueError(f"{where}: its .json must be an object (a row)")
    elif "txt" in members:  # (a caption: the diffusers layout's row)
        row = {"prompt": members["txt"].decode().strip()}
    else:
        raise ValueError(f"{where}: it has no .json row and no .txt caption ({sorted(members)})")
    for column, kinds in (("image", _IMAGES), ("video", _VIDEOS)):
        found = next((e for e in kinds if e in members), None)
        if found is not None and column not in row:
            row[column] = f"{stem}.{found}"
    for ext, data in members.items():
        if ext not in ("json", "txt"):
            (root / f"{stem}.{ext}").write_bytes(data)
    (root / f"{stem}.json").write_text(json.dumps(row))
    rows.write(json.dumps(row) + "\n")


def unpacked(name: str, *, key: str) -> Path:
    """The cache folder of the shards `name`, unpacked first if it is not there (by one process
    at a time: the others wait for it and read it). `key` names the config key in errors."""
    root = shard_folder(name)
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root.is_dir():  # (another process unpacked it meanwhile)
            return root
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            with (partial / ROWS).open("w") as rows:
                for sample in _samples(shard_urls(name, key=key), key):
                    _write(sample, partial, rows, key)
            (partial / "SOURCE").write_text(name + "\n")
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.replace(partial, root)
    return root


def unpack_datasets(cfg: Config) -> list[Path]:
    """The folders of the job's shard datasets (training's, and validation's when it runs),
    unpacked first where needed: `nebula-rl train` calls this before any process starts, so
    that the job's processes (the controller among them) find them ready."""
    wanted = [(cfg.train.train_policy.dataset, "train.train_policy.dataset.name")]
    if cfg.validation.enable:
        wanted.append((cfg.validation.dataset, "validation.dataset.name"))
    return [
        unpacked(ds.name, key=key) for ds, key in wanted if not ds.local_dir and is_shards(ds.name)
    ]
