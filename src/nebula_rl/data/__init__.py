"""Datasets: local files and folders, Hugging Face Hub datasets, WebDataset shards, built-in
verifiable tasks, chat templating.

Rows are plain dicts. JSON lines files are read line by line here; other local sources with
Hugging Face `datasets` (JSON, Parquet, CSV, or a folder written by `Dataset.save_to_disk`); a Hub
dataset id (`openai/gsm8k`) with `datasets.load_dataset`, which caches it in the Hugging Face
cache; WebDataset shards (local or `s3://`) from the folder :mod:`nebula_rl.data.shards` unpacks
them into; `builtin:<task>` names a procedurally generated task from :data:`BUILTIN_TASKS`. Rows a mode cannot
use (a line that is not a JSON object, a missing column, an empty prompt, a prompt that is neither
text nor chat messages) are counted and reported by :func:`validate_rows` (the log, and
`RowReport`), never silently dropped and never fatal.

The controller reads datasets, so this module imports neither `datasets` nor `transformers` (nor
torch) at import time: `datasets` is imported where a dataset is read.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nebula_rl.config import Config, DatasetConfig, GrpoConfig, TrainingConfig
from nebula_rl.data.formats import UNUSABLE, conversation_rows, prompt_rows
from nebula_rl.data.judge import brightness_judge_task
from nebula_rl.data.shards import ROWS, is_shards, unpacked
from nebula_rl.protocol import Prompt
from nebula_rl.utils.hub import is_hub_id

if TYPE_CHECKING:  # (the controller imports this module: no transformers at run time)
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "BUILTIN_TASKS",
    "MALFORMED",
    "RowReport",
    "arithmetic_task",
    "epoch_order",
    "load_hub_rows",
    "load_rows",
    "num_train_steps",
    "prompt_messages",
    "prompt_token_ids",
    "rl_dataset",
    "rl_prompt",
    "rl_rows",
    "rl_validation_rows",
    "sft_example",
    "sft_rows",
    "split_rows",
    "validate_rows",
]

log = logging.getLogger(__name__)

MALFORMED = "__malformed__"
"""Key of the placeholder row `load_rows` gives for a line it could not read (the value says why),
so that :func:`validate_rows` counts it with the other unusable rows."""
BUILTIN_PREFIX = "builtin:"
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def arithmetic_task(
    *,
    num_samples: int = 1000,
    max_operand: int = 9,
    ops: str = "+",
    seed: int = 0,
    **unknown: Any,
) -> list[dict[str, str]]:
    """Procedural arithmetic: prompt `"a+b="`, answer the integer result as text.

    With single-digit operands and `+` there are 100 distinct problems; rows repeat them in a
    seeded random order so an epoch of `num_samples` rows is reproducible.
    """
    if unknown:
        raise ValueError(f"builtin:arithmetic: unknown option(s) {sorted(unknown)}")
    if num_samples < 1 or max_operand < 1 or not ops or set(ops) - set("+-*"):
        raise ValueError(
            "builtin:arithmetic: need num_samples >= 1, max_operand >= 1, ops in '+-*'"
        )
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(value)})
    return rows


_SQUARE_COLOURS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
                   (145, 30, 180), (70, 240, 240), (240, 50, 230)]  # fmt: skip
SQUARES_QUESTION = "How many squares?"


def squares_task(
    *,
    num_samples: int = 1000,
    max_squares: int = 4,
    size: int = 64,
    seed: int = 0,
    **unknown: Any,
) -> list[dict[str, Any]]:
    """A visual counting task: a black `size` x `size` image cut into a 4 x 4 grid, 1 to
    `max_squares` of whose cells are painted in colours; the question is "How many squares?",
    the answer the digit.

    Each row holds the image as a PNG `data:` URI and gives the task three ways: `conversations`
    (for SFT: the user's image and question, the assistant's
    `<think>N squares</think>\n\n<answer>N</answer>`), `prompt` (the user turn alone, for RL)
    and `answer` (the digit).
    """
    if unknown:
        raise ValueError(f"builtin:squares: unknown option(s) {sorted(unknown)}")
    if num_samples < 1 or not 1 <= max_squares <= 16 or size < 16 or size % 4:
        raise ValueError(
            "builtin:squares: need num_samples >= 1, 1 <= max_squares <= 16 and size a multiple "
            "of 4, at least 16"
        )
    import base64
    import io

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    cell = size // 4
    rows = []
    for _ in range(num_samples):
        count = rng.randint(1, max_squares)
        image = Image.new("RGB", (size, size))
        draw = ImageDraw.Draw(image)
        for index in rng.sample(range(16), count):
            x, y = (index % 4) * cell, (index // 4) * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=rng.choice(_SQUARE_COLOURS))
        png = io.BytesIO()
        image.save(png, format="PNG")
        uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        user = {
            "role": "user",
            "content": [
                {"type": "image", "image": uri},
                {"type": "text", "text": SQUARES_QUESTION},
            ],
        }
        reply = f"<think>{count} squares</think>\n\n<answer>{count}</answer>"
        rows.append(
            {
                "conversations": [user, {"role": "assistant", "content": reply}],
                "prompt": [user],
                "answer": str(count),
            }
        )
    return rows


BUILTIN_TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "arithmetic": arithmetic_task,
    "squares": squares_task,
    "brightness_judge": brightness_judge_task,
}


def _local_files(path: Path, splits: Sequence[str], *, key: str) -> tuple[str, list[str]]:
    if path.is_file():
        files = [path]
    else:
        files = [
            f for split in splits for f in sorted(path.glob(f"{split}*")) if f.suffix in _FORMATS
        ]
        if not files:
            raise ValueError(
                f"{key}: {path} holds no {'/'.join(_FORMATS)} file for split(s) {list(splits)}"
            )
    kinds = {_FORMATS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"{key}: cannot read {[str(f) for f in files]}: one of {sorted(_FORMATS)}")
    return kinds.pop(), [str(f) for f in files]  # type: ignore[return-value]


def load_rows(ds: DatasetConfig, *, seed: int = 0) -> list[dict[str, Any]]:
    """All rows of the configured splits, in file (or split) order.

    `dataset.name` is a built-in task, a local file or folder, a Hugging Face Hub dataset id, or
    WebDataset shards (local or `s3://`, :mod:`nebula_rl.data.shards`);
    a non-empty `dataset.local_dir` is the local folder holding the dataset, read instead of
    `name` (see :func:`load_hub_rows`).
    """
    if ds.name.startswith(BUILTIN_PREFIX):
        task = ds.name.removeprefix(BUILTIN_PREFIX)
        if task not in BUILTIN_TASKS:
            raise ValueError(
                f"dataset.name: unknown built-in task {task!r}; choose from {sorted(BUILTIN_TASKS)}"
            )
        return BUILTIN_TASKS[task](**{"seed": seed, **ds.kwargs})
    # The config's default split is the bare string "train" (pydantic does not run validators
    # on defaults), which would otherwise be read as the splits "t", "r", "a", ...
    splits = [ds.split] if isinstance(ds.split, str) else list(ds.split)
    # `local_dir` is being added to DatasetConfig alongside this code; until then it is absent.
    local_dir: str = getattr(ds, "local_dir", "")
    if not local_dir and is_shards(ds.name):
        if splits != ["train"]:
            raise ValueError(
                f"dataset.split = {splits}: WebDataset shards ({ds.name}) have no splits; name "
                "each split's shards as its own dataset"
            )
        return _json_lines(unpacked(ds.name, key="dataset.name") / ROWS)
    if local_dir or is_hub_id(ds.name):
        return load_hub_rows(
            ds.name, subset=ds.subset, revision=ds.revision, splits=splits, local_dir=local_dir
        )
    if not ds.name:
        raise ValueError(
            "dataset.name: empty; give a local file/folder, a Hub dataset id or builtin:<task>"
        )
    path = Path(ds.name)
    if not path.exists():
        raise ValueError(
            f"dataset.name: {path} does not exist, and it is not a Hugging Face Hub dataset id "
            "(owner/name) either"
        )
    return _local_rows(path, splits, key="dataset.name")


def load_hub_rows(
    name: str,
    *,
    subset: str,
    revision: str,
    splits: Sequence[str],
    local_dir: str = "",
) -> list[dict[str, Any]]:
    """The rows of `splits` (concatenated in that order) of the Hub dataset `name`, loaded with
    `datasets.load_dataset(name, subset, revision=revision, split=...)` through the Hugging Face
    cache; or, as cosmos-rl does, of the local folder `local_dir` when it is given (`name` then
    only names the dataset; the folder is read like a local `dataset.name`).

    With `HF_HUB_OFFLINE=1`, datasets serves the copy it prepared most recently in its cache and
    cannot tell its revision. A dataset the cache lacks, an unknown subset or split, and the
    Hub's refusals are ValueErrors naming `dataset.name`.
    """
    if local_dir:
        path = Path(local_dir)
        if not path.exists():
            raise ValueError(
                f"dataset.local_dir: {path} (holding {name or 'the dataset'}) does not exist"
            )
        return _local_rows(path, splits, key="dataset.local_dir")
    import datasets

    what = f"dataset.name: {name} (subset {subset or 'default'}, revision {revision or 'main'})"
    offline = datasets.config.HF_HUB_OFFLINE
    if offline and revision:
        log.warning(
            "%s: HF_HUB_OFFLINE=1, so datasets serves its most recently prepared copy of %s, "
            "whatever its revision",
            what,
            name,
        )
    rows: list[dict[str, Any]] = []
    for split in splits:
        try:
            table = datasets.load_dataset(
                name, subset or None, revision=revision or None, split=split
            )
        except ConnectionError as err:
            if offline:
                raise ValueError(
                    f"{what} is not in the Hugging Face datasets cache "
                    f"({datasets.config.HF_DATASETS_CACHE}) and HF_HUB_OFFLINE=1 forbids "
                    "downloading it; load it once where the network is reachable, or unset "
                    "HF_HUB_OFFLINE, or set dataset.local_dir to a local copy (split files or a "
                    "save_to_disk folder)"
                ) from err
            raise ValueError(f"{what}: the Hub could not be reached ({_one_line(err)})") from err
        except (OSError, ValueError) as err:
            # datasets' own messages say what is missing (repository, revision, subset, split,
            # data files) or that the dataset is gated; they lack which config key it was.
            raise ValueError(f"{what}: {_one_line(err)}") from err
        rows.extend(table)  # type: ignore[arg-type]
    return rows


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _local_rows(path: Path, splits: Sequence[str], *, key: str) -> list[dict[str, Any]]:
    """The rows of a local file or folder (`key` names the config key that gave `path`)."""
    saved = ("dataset_info.json", "state.json", "dataset_dict.json")
    if path.is_dir() and any((path / name).exists() for name in saved):
        import datasets

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            return [row for split in splits for row in loaded[split]]
        return list(loaded)
    kind, files = _local_files(path, splits, key=key)
    if all(f.endswith(".jsonl") for f in files):
        return [row for f in files for row in _json_lines(Path(f))]
    if all(f.endswith(".json") for f in files):
        arrays = [_json_array(Path(f)) for f in files]
        if all(a is not None for a in arrays):
            return [row for a in arrays for row in a or ()]
    import datasets

    table = datasets.load_dataset(kind, data_files=files, split="train")
    return list(table)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON lines file; a line that is not a JSON object becomes a
    :data:`MALFORMED` placeholder (blank lines are skipped)."""
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                rows.append({MALFORMED: "not valid JSON"})
                continue
            if not isinstance(row, dict):
                rows.append({MALFORMED: "not a JSON object"})
                continue
            rows.append(row)
    return rows


def _json_array(path: Path) -> list[dict[str, Any]] | None:
    """The rows of a file holding one JSON array (LLaVA's annotation files), read as they are:
    Arrow cannot type a column that holds a string in one row and a list in another (`image`).
    An element that is not an object becomes a :data:`MALFORMED` placeholder; None when the
    file is not one array (then `datasets` reads it)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
        if not head.startswith("["):
            return None
        f.seek(0)
        try:
            value = json.load(f)
        except json.JSONDecodeError:
            return None
    return [row if isinstance(row, dict) else {MALFORMED: "not a JSON object"} for row in value]


def split_rows(
    rows: list[dict[str, Any]], test_size: float | int | None, *, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) by a seeded shuffle; `test_size` is a fraction or a row count."""
    if not test_size:
        return rows, []
    n_test = round(len(rows) * test_size) if isinstance(test_size, float) else test_size
    if not 0 < n_test < len(rows):
        raise ValueError(
            f"dataset.test_size: {test_size} leaves no train or no test rows of {len(rows)}"
        )
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test = {*order[:n_test]}
    return [r for i, r in enumerate(rows) if i not in test], [rows[i] for i in sorted(test)]


@dataclass(frozen=True, slots=True)
class RowReport:
    """How many rows were usable, and why the others were not."""

    num_rows: int
    num_bad: int
    reasons: dict[str, int]

    def summary(self) -> str:
        """One line for the log."""
        if not self.num_bad:
            return f"{self.num_rows} rows, all usable"
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.reasons.items()))
        return f"{self.num_rows} rows, {self.num_bad} unusable ({why})"


def _is_prompt(value: Any) -> bool:
    """Text, or chat messages (a list of {"role": str, "content": str, or a list of content
    items: {"type": "text" | "image" | "video", ...}, see `data.vision`)."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content"))
        for m in value
    )


def _is_content(content: Any) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(item, dict) and item.get("type") in ("text", "image", "video")
        for item in content
    )


def _problem(row: dict[str, Any], columns: Sequence[str], prompts: Sequence[str]) -> str | None:
    """Why `row` is unusable, None if it is usable."""
    if MALFORMED in row:
        return f"malformed line ({row[MALFORMED]})"
    if UNUSABLE in row:
        return str(row[UNUSABLE])
    missing = next((c for c in columns if c not in row or row[c] in (None, "", [])), None)
    if missing is not None:
        return f"missing or empty '{missing}'"
    wrong = next((c for c in prompts if not _is_prompt(row[c])), None)
    if wrong is not None:
        return f"'{wrong}' is neither text nor chat messages"
    return None


def validate_rows(
    rows: list[dict[str, Any]], *, columns: Sequence[str], prompts: Sequence[str] = ()
) -> tuple[list[dict[str, Any]], RowReport]:
    """Keep rows whose `columns` are present and non-empty (and whose `prompts` columns hold
    text or chat messages); count the rest by reason, malformed lines included."""
    good: list[dict[str, Any]] = []
    reasons: dict[str, int] = {}
    for row in rows:
        problem = _problem(row, columns, prompts)
        if problem is None:
            good.append(row)
        else:
            reasons[problem] = reasons.get(problem, 0) + 1
    report = RowReport(num_rows=len(rows), num_bad=len(rows) - len(good), reasons=reasons)
    if report.num_bad:
        log.warning("dataset: %s", report.summary())
    return good, report


def prompt_messages(
    prompt: str | Sequence[dict[str, Any]], system_prompt: str
) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string becomes the user's turn; `system_prompt` (if any)
    goes first unless the messages start with their own."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict[str, str]],
    *,
    system_prompt: str = "",
) -> list[int]:
    """Token ids of a prompt ready for generation: chat template with the assistant header when
    the tokenizer has one, else the raw text."""
    if tokenizer.chat_template is None:
        if not isinstance(prompt, str):
            raise ValueError("chat-message prompts need a tokenizer with a chat template")
        return tokenizer.encode(system_prompt + prompt, add_special_tokens=True)
    return _render(tokenizer, prompt_messages(prompt, system_prompt), add_generation_prompt=True)


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template."""
    out: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return [int(t) for t in out["input_ids"]]


def sft_example(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    *,
    system_prompt: str = "",
    max_length: int | None = None,
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation; the mask is 1 on assistant tokens only.

    Works with any chat template: the template is rendered on growing prefixes of the
    conversation and each assistant turn owns the tokens its prefix adds after the generation
    prompt, so it covers the reply and its end-of-turn token.
    """
    messages = prompt_messages(messages, system_prompt)
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            head = _render(tokenizer, messages[:i], add_generation_prompt=True)
            mask += [0] * (len(head) - len(ids))
            ids = head
        full = _render(tokenizer, messages[: i + 1])
        if full[: len(ids)] != ids:
            raise ValueError("chat template is not prefix-stable; cannot mask assistant turns")
        mask += [int(msg["role"] == "assistant")] * (len(full) - len(ids))
        ids = full
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def epoch_order(num_rows: int, *, epoch: int, shuffle: bool, seed: int) -> list[int]:
    """Row indices in the order epoch `epoch` visits them (a seeded shuffle per epoch)."""
    order = list(range(num_rows))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def num_train_steps(train: TrainingConfig, num_items: int, *, items_per_step: int) -> int:
    """Optimiser steps of a run: full batches of `items_per_step` dataset rows (a step's prompts
    over all policy replicas for RL, its conversations over all data-parallel ranks for SFT)
    over all epochs, capped by `train.max_num_steps`."""
    steps = train.epoch * (num_items // items_per_step)
    if train.max_num_steps is not None:
        steps = min(steps, train.max_num_steps)
    if steps < 1:
        raise ValueError(
            f"train.train_batch_per_replica ({train.train_batch_per_replica}): a step takes "
            f"{items_per_step} of the {num_items} usable dataset rows: no full step"
        )
    return steps


def rl_prompt(
    grpo: GrpoConfig,
    rows: list[dict[str, Any]],
    *,
    epoch: int,
    index: int,
    min_version: int = 0,
    with_text: bool = True,
    validation_step: int | None = None,
) -> Prompt:
    """The prompt of dataset row `index` handed out in `epoch` (`prompt_id` `"<epoch>:<index>"`),
    or, with `validation_step`, of validation row `index` (`"val<step>:<index>"`, `rows` the
    validation rows). Without `with_text` it carries no prompt and reference: the replica reads
    them from its own copy of the rows (`train.local_dataset`)."""
    p = grpo
    row = rows[index]
    prompt_id = f"{epoch}:{index}" if validation_step is None else f"val{validation_step}:{index}"
    return Prompt(
        prompt_id=prompt_id,
        epoch=epoch,
        index=index,
        prompt=row[p.prompt_column_name] if with_text else None,
        reference=str(row[p.response_column_name]) if with_text else None,
        min_version=min_version,
        validation_step=validation_step,
    )


def _rl_rows_of(cfg: Config, ds: DatasetConfig, *, key: str) -> list[dict[str, Any]]:
    """The rows of an RL dataset, multiple-choice questions and media columns written into the
    prompt column (see `nebula_rl.data.formats`)."""
    p = cfg.grpo
    return prompt_rows(
        load_rows(ds, seed=cfg.train.seed or 0),
        ds,
        key=key,
        prompt_column=p.prompt_column_name,
        response_column=p.response_column_name,
        system_prompt=p.system_prompt,
    )


def sft_rows(ds: DatasetConfig, column: str, *, key: str, seed: int) -> list[dict[str, Any]]:
    """The rows of an SFT dataset, LLaVA turns and media columns written into the conversation
    column `column` (see `nebula_rl.data.formats`)."""
    return conversation_rows(load_rows(ds, seed=seed), ds, key=key, column=column)


def _rl_split(
    cfg: Config,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], RowReport]:
    """(training rows, held-out `test_size` rows, the report on unusable rows) of the RL
    dataset."""
    p = cfg.grpo
    seed = cfg.train.seed or 0
    rows, report = validate_rows(
        _rl_rows_of(cfg, p.dataset, key="train.train_policy.dataset"),
        columns=[p.prompt_column_name, p.response_column_name],
        prompts=[p.prompt_column_name],
    )
    if not rows:
        raise ValueError(f"dataset.name: {p.dataset.name} has no usable row: {report.summary()}")
    train, held_out = split_rows(rows, p.dataset.test_size, seed=seed)
    return train, held_out, report


def rl_dataset(cfg: Config) -> tuple[list[dict[str, Any]], RowReport]:
    """The RL training rows of `cfg` (loaded, checked for the prompt and answer columns, without
    the held-out `test_size` split) and the report on the rows that could not be used."""
    train, _held_out, report = _rl_split(cfg)
    return train, report


def rl_validation_rows(cfg: Config) -> list[dict[str, Any]]:
    """The RL validation rows: `validation.dataset` (read with the training columns), else the
    training dataset's held-out `test_size` part; the first `validation.max_num_prompts`."""
    p, v = cfg.grpo, cfg.validation
    if v.dataset.name:
        rows, report = validate_rows(
            _rl_rows_of(cfg, v.dataset, key="validation.dataset"),
            columns=[p.prompt_column_name, p.response_column_name],
            prompts=[p.prompt_column_name],
        )
        where = f"validation.dataset.name: {v.dataset.name} has no usable row: {report.summary()}"
    else:
        _train, rows, _report = _rl_split(cfg)
        where = (
            "validation.enable: no validation rows; set validation.dataset.name or "
            "train.train_policy.dataset.test_size"
        )
    if not rows:
        raise ValueError(where)
    return rows[: v.max_num_prompts]


def rl_rows(cfg: Config) -> list[dict[str, Any]]:
    """The RL training rows of `cfg` (see :func:`rl_dataset`)."""
    return rl_dataset(cfg)[0]
