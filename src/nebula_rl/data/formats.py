"""The row forms vision-language datasets ship in, turned into chat conversations once, when the
rows are read, so that every side of a job (controller, rollout, policy) sees the same messages.

Three forms are recognised, by their shape, whatever the column names:

- **Multiple-choice questions** (Cosmos-Reason's RL datasets): the prompt column holds
  `{"question": str, "index2ans": {letter: text}, "answer": letter}`. The user's text is the
  question, one line `(A) text` per choice, then :data:`CHOICE_INSTRUCTION` and
  :data:`FORMAT_INSTRUCTION`; the conversation opens with the system turn (`system_prompt`, empty
  by default, as the recipe renders it); the reference is `answer` unless the row has its own
  reference column.
- **Media columns** (Cosmos-Reason, LLaVA): a row's `image` / `video` column holds a file name,
  a path or a list of them. Their content items go first in the user turns that are plain text:
  every user turn of a `role`/`content` conversation (Cosmos-Reason's SFT rows), the turn holding
  the `<image>` / `<video>` tag in LLaVA rows (else the first). Each item takes the dataset's
  `media_settings` for its kind (Cosmos-Reason's `fps = 1`, `max_pixels = 81920` for videos by
  default).
- **LLaVA conversations**: `[{"from": "human" | "gpt" | "system", "value": str}, ...]`, tags
  removed from the text.

Media names are found under a media folder: `dataset.media_dir` when set; for a Hub dataset (or
one read from `local_dir`) the folder cosmos-rl extracts its clips to,
`$COSMOS_CACHE/datasets/<name>/<subset>/video_clips` (filled from the dataset's
`<subset>/clips/*.tar.gz` archives on first use, see :func:`prepare_clips`); for WebDataset
shards, the folder they unpack into (:mod:`nebula_rl.data.shards`); for a local file, its
folder. A name is tried as a path below the folder, then by its file name anywhere in it (as
cosmos-reason's scripts look clips up). URLs and `data:` URIs pass as they are. A row whose media
cannot be found is unusable and counted (never fatal, never silently dropped).

Nothing here imports torch or transformers: the controller reads rows.
"""

from __future__ import annotations

import logging
import os
import re
import tarfile
from pathlib import Path
from typing import Any

from nebula_rl.config import DatasetConfig
from nebula_rl.data.shards import is_shards, unpacked
from nebula_rl.utils.hub import is_hub_id

__all__ = [
    "CHOICE_INSTRUCTION",
    "FORMAT_INSTRUCTION",
    "MEDIA_COLUMNS",
    "UNUSABLE",
    "MediaFinder",
    "conversation_rows",
    "cosmos_clips_dir",
    "multiple_choice_text",
    "prepare_clips",
    "prompt_rows",
]

log = logging.getLogger(__name__)

UNUSABLE = "__unusable__"
"""Key of the placeholder a row becomes when its form cannot be used (the value says why)."""
MEDIA_COLUMNS = ("image", "video")
CHOICE_INSTRUCTION = "Answer with the option's letter from the given choices directly."
FORMAT_INSTRUCTION = (
    "Please answer the question in the following format: "
    "<think> your reasoning </think> <answer> your answer </answer>."
)
_PASS_THROUGH = ("http://", "https://", "data:", "file://")
_LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "system": "system"}  # fmt: skip
_TAG = re.compile(r"<(image|video)>\n?")


def multiple_choice_text(qa: dict[str, Any]) -> str:
    """The user's text for a multiple-choice question, as Cosmos-Reason's RL recipe writes it."""
    choices = "\n".join(f"({letter}) {text}" for letter, text in qa["index2ans"].items())
    return f"{qa['question']}\n{choices}\n{CHOICE_INSTRUCTION}\n{FORMAT_INSTRUCTION}"


def _is_multiple_choice(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("question"), str)
        and isinstance(value.get("index2ans"), dict)
        and bool(value["index2ans"])
    )


def cosmos_clips_dir(ds: DatasetConfig) -> Path:
    """Where cosmos-rl extracts a Hub dataset's clips (shared with it: a prepared cache is
    reused): `$COSMOS_CACHE/datasets/<owner/name>/<subset>/video_clips`."""
    cache = Path(os.environ.get("COSMOS_CACHE", Path.home() / ".cache" / "cosmos"))
    name = "/".join(ds.name.rstrip("/").split("/")[-2:])
    return cache / "datasets" / name / ds.subset / "video_clips"


def prepare_clips(ds: DatasetConfig, key: str) -> Path:
    """Extract the dataset's `<subset>/clips/*.tar.gz` archives into :func:`cosmos_clips_dir`
    once (a `.prepared` marker, a file lock against the job's other processes), taking them from
    `dataset.local_dir` when set, else downloading them from the Hub dataset repository with
    `huggingface_hub`. Returns the folder."""
    from filelock import FileLock

    target = cosmos_clips_dir(ds)
    done = target / ".prepared"
    if done.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / "prepare.lock"), timeout=3600):
        if done.exists():
            return target
        pattern = f"{ds.subset}/clips/*.tar.gz" if ds.subset else "clips/*.tar.gz"
        if ds.local_dir:
            archives = sorted(Path(ds.local_dir).glob(pattern))
        else:
            archives = _download_clips(ds, pattern, key)
        for archive in archives:
            with tarfile.open(archive) as tar:
                tar.extractall(target, filter="data")
        log.info("%s: %d clip archive(s) extracted to %s", key, len(archives), target)
        done.touch()
    return target


def _download_clips(ds: DatasetConfig, pattern: str, key: str) -> list[Path]:
    import fnmatch

    from huggingface_hub import list_repo_files, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        files = list_repo_files(ds.name, repo_type="dataset", revision=ds.revision or None)
        if not any(fnmatch.fnmatch(f, pattern) for f in files):
            return []
        folder = snapshot_download(
            ds.name, repo_type="dataset", revision=ds.revision or None, allow_patterns=[pattern]
        )
    except (OSError, HfHubHTTPError, OfflineModeIsEnabled) as err:
        raise ValueError(
            f"{key}: the media of {ds.name} ({pattern} in its Hub repository) could not be "
            f"fetched ({' '.join(str(err).split())}); set {key.rsplit('.', 1)[0]}.media_dir to a "
            "local folder holding them"
        ) from err
    return sorted(Path(folder).glob(pattern))


class MediaFinder:
    """Resolves media names to paths under one folder (built on first use)."""

    def __init__(self, ds: DatasetConfig, key: str) -> None:
        self.ds, self.key = ds, key
        self._root: Path | None = None
        self._by_name: dict[str, Path] | None = None

    @property
    def root(self) -> Path:
        if self._root is None:
            ds = self.ds
            if ds.media_dir:
                self._root = Path(ds.media_dir)
            elif not ds.local_dir and is_shards(ds.name):
                self._root = unpacked(ds.name, key=self.key)
            elif ds.local_dir or is_hub_id(ds.name):
                self._root = prepare_clips(ds, self.key)
            else:
                path = Path(ds.name)
                self._root = path if path.is_dir() else path.parent
        return self._root

    def __call__(self, source: Any) -> Any:
        """The path of `source` (a name or path); URLs, `data:` URIs and non-strings as they
        are. Raises LookupError when it is nowhere under the folder."""
        if not isinstance(source, str) or source.startswith(_PASS_THROUGH):
            return source
        path = Path(source)
        if path.is_absolute() and path.exists():
            return source
        if not path.is_absolute() and (self.root / path).exists():
            return str(self.root / path)
        if self._by_name is None:
            self._by_name = {}
            for folder, _dirs, files in os.walk(self.root):
                for file in files:
                    self._by_name.setdefault(file, Path(folder) / file)
        found = self._by_name.get(path.name)
        if found is None:
            raise LookupError(f"media {source!r} not found under {self.root}")
        return str(found)


def _media_kinds(row: dict[str, Any]) -> list[str]:
    """The media columns the row fills."""
    return [kind for kind in MEDIA_COLUMNS if row.get(kind) not in (None, "", [])]


def _media_items(
    row: dict[str, Any], find: MediaFinder, settings: dict[str, dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """The row's media columns as content items, by kind."""
    items: dict[str, list[dict[str, Any]]] = {}
    for kind in _media_kinds(row):
        value = row[kind]
        sources = value if isinstance(value, list) else [value]
        items[kind] = [{"type": kind, kind: find(s), **settings.get(kind, {})} for s in sources]
    return items


def _with_media(
    messages: list[dict[str, Any]], items: dict[str, list[dict[str, Any]]], *, every_turn: bool
) -> list[dict[str, Any]]:
    """`messages` with the media items first in their plain-text user turns: in every such
    turn, or (LLaVA) one item per `<image>` / `<video>` tag in the turn holding it, the items
    without a tag in the first user turn."""
    flat = [item for kind in MEDIA_COLUMNS for item in items.get(kind, [])]
    if not flat:
        return messages
    users = [
        i for i, m in enumerate(messages) if m["role"] == "user" and isinstance(m["content"], str)
    ]
    if not users:
        raise LookupError("the row has media but no plain-text user turn to put them in")
    if every_turn:
        per_turn = dict.fromkeys(users, flat)
    else:
        pending = {kind: list(found) for kind, found in items.items()}
        per_turn = {
            i: [pending[k].pop(0) for k in _TAG.findall(messages[i]["content"]) if pending.get(k)]
            for i in users
        }
        per_turn[users[0]] += [item for kind in MEDIA_COLUMNS for item in pending.get(kind, [])]
    out = []
    for i, message in enumerate(messages):
        if i not in per_turn:
            out.append(message)
            continue
        text = message["content"] if every_turn else _TAG.sub("", message["content"]).strip()
        media = per_turn[i]
        content = [*media, {"type": "text", "text": text}] if media else text
        out.append({**message, "content": content})
    return out


def _llava(messages: list[Any]) -> list[dict[str, Any]] | None:
    """LLaVA's `from`/`value` turns as `role`/`content` messages (None if not that form)."""
    if not messages or not all(isinstance(m, dict) and "from" in m for m in messages):
        return None
    out = []
    for m in messages:
        role = _LLAVA_ROLES.get(str(m["from"]).lower())
        if role is None or not isinstance(m.get("value"), str):
            raise LookupError(f"LLaVA turn from {m['from']!r} is not human, gpt or system text")
        out.append({"role": role, "content": m["value"]})
    return out


def prompt_rows(
    rows: list[dict[str, Any]],
    ds: DatasetConfig,
    *,
    key: str,
    prompt_column: str,
    response_column: str,
    system_prompt: str,
) -> list[dict[str, Any]]:
    """RL rows with multiple-choice prompt columns written out, their reference filled from the
    question when the row has none, and their media columns joined into the user turn; `key`
    names the dataset's config section in errors. Other rows are kept as they are."""
    find = MediaFinder(ds, key)
    out = []
    for row in rows:
        prompt: Any = row.get(prompt_column)
        choice = _is_multiple_choice(prompt)
        if not choice and not _media_kinds(row):
            out.append(row)
            continue
        row = dict(row)
        if choice:
            messages = [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": multiple_choice_text(prompt)},
            ]
            if row.get(response_column) in (None, ""):
                row[response_column] = prompt.get("answer")
        elif isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = prompt
        else:
            out.append(row)
            continue
        try:
            items = _media_items(row, find, ds.media_settings)
            # Cosmos-Reason's RL rows carry one medium: the video wins over the image.
            if "video" in items:
                items.pop("image", None)
            row[prompt_column] = _with_media(messages, items, every_turn=True)
        except LookupError as err:
            out.append({UNUSABLE: str(err)})
            continue
        out.append(row)
    return out


def conversation_rows(
    rows: list[dict[str, Any]], ds: DatasetConfig, *, key: str, column: str
) -> list[dict[str, Any]]:
    """SFT rows with LLaVA turns as chat messages and their media columns joined into the user
    turns (see the module's docstring). Other rows are kept as they are."""
    find = MediaFinder(ds, key)
    out = []
    for row in rows:
        messages = row.get(column)
        media = bool(_media_kinds(row))
        if not isinstance(messages, list) or not messages:
            out.append(row)
            continue
        try:
            llava = _llava(messages)
            if llava is None and not media:
                out.append(row)
                continue
            items = _media_items(row, find, ds.media_settings) if media else {}
            turns = llava if llava is not None else messages
            converted = _with_media(turns, items, every_turn=llava is None)
        except LookupError as err:
            out.append({UNUSABLE: str(err)})
            continue
        out.append({**row, column: converted})
    return out
