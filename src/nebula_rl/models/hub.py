"""Model names: a local Hugging Face folder, or a Hub repo id fetched into the Hugging Face cache.

A name that is an existing folder is used as is. A name shaped like a Hub repo id
(`Qwen/Qwen2.5-7B-Instruct`) is fetched with `huggingface_hub.snapshot_download` into the usual
cache (`HF_HUB_CACHE`, default `$HF_HOME/hub`), as transformers would; with `HF_HUB_OFFLINE=1` the
cache alone serves it. Only the files a causal LM and its tokenizer need are fetched: configs,
tokenizer files, chat templates and the root folder's safetensors (PyTorch `.bin` weights only for
repos without safetensors; TF, Flax, GGUF and ONNX copies never), and the weight files in other
folders that the root's safetensors index names: a unified Cosmos 3 checkpoint
(`nvidia/Cosmos3-Nano`) is a diffusers pipeline whose reasoner weights transformers reads from its
`transformer/` and `vision_encoder/` folders through the root index. Presets (`tiny:`) are the
callers' business. Imports of `huggingface_hub` stay inside the functions, so importing this
module costs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from nebula_rl.utils.hub import is_hub_id

__all__ = ["MODEL_FILES", "is_hub_id", "resolve_model"]

MODEL_FILES = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.safetensors"]
"""Files fetched from a model repo: config.json, generation_config.json, tokenizer.json,
tokenizer_config.json, vocab.json, special_tokens_map.json, chat_template.json/.jinja,
sentencepiece `*.model`, merges.txt/vocab.txt, tiktoken vocabularies and the (sharded)
safetensors with their index."""

_PYTORCH_WEIGHTS = ["pytorch_model*.bin"]
# transformers reads the weights of the root folder (and those its root index names elsewhere,
# fetched on their own); other copies in subfolders (quantised variants, `original/`) and
# Mistral's consolidated.safetensors (the same weights in mistral-inference's layout) would
# double the download.
_SKIPPED_FILES = ["*/*.safetensors", "*/*.bin", "consolidated*"]


def resolve_model(
    name_or_path: str,
    *,
    revision: str | None = None,
    key: str = "policy.model_name_or_path",
) -> Path:
    """The local folder of a model: `name_or_path` itself if it is a folder, else the snapshot of
    the Hub repo `name_or_path` at `revision` (a branch, tag or commit hash; default `main`),
    downloaded into the Hugging Face cache unless it is there already.

    Every failure is a ValueError naming `key`: a folder without config.json, a name that is
    neither a folder nor a repo id, a repo the cache lacks under `HF_HUB_OFFLINE=1`, and the Hub's
    own refusals (unknown repo or revision, gated or private repo, unreachable Hub).
    """
    if not name_or_path:
        raise ValueError(f"{key}: empty; give a local model folder or a Hugging Face Hub id")
    path = Path(name_or_path)
    if not path.is_dir():
        if not is_hub_id(name_or_path):
            raise ValueError(
                f"{key}: {name_or_path!r} is neither a local folder nor a Hugging Face Hub id "
                "(owner/name)"
            )
        path = _snapshot(name_or_path, revision=revision, key=key)
    if not (path / "config.json").is_file():
        raise ValueError(f"{key}: {path} has no config.json; it is not a Hugging Face model folder")
    return path


def _snapshot(repo_id: str, *, revision: str | None, key: str) -> Path:
    """The cached snapshot folder of `repo_id`, fetched with the model files and the weights."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=MODEL_FILES,
                ignore_patterns=_SKIPPED_FILES,
            )
        )
        nested = indexed_weight_files(folder)
        if nested:  # (pinned to the commit just fetched)
            folder = Path(snapshot_download(repo_id, revision=folder.name, allow_patterns=nested))
        elif not any(folder.glob("*.safetensors")):
            # An older repo with PyTorch weights only; pinned to the commit just fetched.
            folder = Path(
                snapshot_download(
                    repo_id,
                    revision=folder.name,
                    allow_patterns=[*MODEL_FILES, *_PYTORCH_WEIGHTS],
                    ignore_patterns=_SKIPPED_FILES,
                )
            )
    except (HfHubHTTPError, LocalEntryNotFoundError) as err:
        raise _hub_error(err, repo_id=repo_id, revision=revision, key=key) from err
    return folder


def indexed_weight_files(folder: Path) -> list[str]:
    """The weight files in subfolders of `folder` that its root safetensors index names (their
    paths within the repo), which the root-only fetch leaves out."""
    names: set[str] = set()
    for index in folder.glob("*.safetensors.index.json"):
        names.update(json.loads(index.read_text()).get("weight_map", {}).values())
    return sorted(name for name in names if "/" in name)


def _hub_error(err: Exception, *, repo_id: str, revision: str | None, key: str) -> ValueError:
    """What a failed fetch of `repo_id` means for the user, and what to do about it."""
    from huggingface_hub import constants, is_offline_mode
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{key}: {repo_id} (revision {revision or 'main'})"
    cause = _first_line(err)
    fetch = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    login = "set `HF_TOKEN` or run `hf auth login`"
    if isinstance(err, IncompleteSnapshotError):
        return ValueError(
            f"{what}: the copy in the Hugging Face cache ({constants.HF_HUB_CACHE}) is incomplete "
            f"({cause}); run {fetch} where the network is reachable"
        )
    if isinstance(err, GatedRepoError):
        return ValueError(
            f"{what} is gated: accept its terms on https://huggingface.co/{repo_id} and {login} "
            f"with a token of that account ({cause})"
        )
    if isinstance(err, RepositoryNotFoundError):
        return ValueError(
            f"{what}: the Hub has no such repository, or it is private and needs a token "
            f"({login}); it is not a local folder either ({cause})"
        )
    if isinstance(err, RevisionNotFoundError):
        return ValueError(
            f"{what}: the repository has no revision {revision or 'main'!r} (a branch, tag or commit "
            f"hash) ({cause})"
        )
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code
        if status in (401, 403):
            return ValueError(f"{what}: the Hub refused access (HTTP {status}); {login} ({cause})")
        return ValueError(f"{what}: the Hub answered with an error ({cause})")
    if is_offline_mode():
        return ValueError(
            f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE=1 forbids downloading it; run {fetch} where the network is "
            "reachable, or unset HF_HUB_OFFLINE"
        )
    return ValueError(
        f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub could "
        f"not be reached ({_first_line(err.__cause__ or err)}); check the network (or HF_ENDPOINT), or run "
        f"{fetch} where the network is reachable"
    )


def _first_line(err: BaseException) -> str:
    """The first line of an error's message (the Hub's run to five, with the request id)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
