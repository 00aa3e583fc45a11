"""Hugging Face Hub ids for models and datasets, without a network: caches laid out as the
libraries lay them out, under `HF_HUB_OFFLINE=1`.

huggingface_hub and datasets read `HF_HOME`, `HF_HUB_CACHE` and `HF_HUB_OFFLINE` once, at import,
into module constants; in-process tests therefore set the environment variables and those
constants (as the libraries' own test suites do), and one test runs a fresh process with the
environment variables alone.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch

from nebula_rl.config import DatasetConfig
from nebula_rl.data import load_hub_rows, load_rows
from nebula_rl.models import build_char_tokenizer, is_hub_id, load_model, load_tokenizer
from nebula_rl.models.hub import resolve_model

REPO = "nebula-test/tiny-qwen2"
OLD, NEW = "a" * 40, "b" * 40  # commits: the tag v1 points at OLD, main at NEW
DATASET = "nebula-test/tiny-math"
GSM8K = Path(__file__).parents[1] / "data" / "gsm8k"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME under tmp_path, offline."""
    home = tmp_path / "hf"
    for name, value in _env(home).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return home


def _env(home: Path) -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1"}


def _cache_model(cache: Path, repo_id: str, folder: Path, commit: str, refs: list[str]) -> Path:
    """Put a model folder into the hub cache as `snapshot_download` leaves it:
    `models--<owner>--<name>/{blobs/<hash>, snapshots/<commit>/<file> -> blob, refs/<ref>}`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in folder.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _export(path: Path, seed: int) -> torch.nn.Module:
    model = load_model("tiny:qwen2", seed=seed)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return model


@pytest.fixture
def cached_model(hf_home: Path, tmp_path: Path) -> dict[str, torch.nn.Module]:
    """REPO in the hub cache: commit OLD (tag v1) and commit NEW (main), different weights."""
    models = {}
    for commit, seed, refs in [(OLD, 1, ["v1"]), (NEW, 2, ["main"])]:
        models[commit] = _export(tmp_path / commit, seed)
        _cache_model(hf_home / "hub", REPO, tmp_path / commit, commit, refs)
    return models


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    x = torch.tensor([[5, 6, 7, 8]])
    return torch.equal(a(x).logits, b(x).logits)


def test_cache_layout_is_the_libraries(cached_model, hf_home):
    (repo,) = huggingface_hub.scan_cache_dir(hf_home / "hub").repos
    assert (repo.repo_id, repo.repo_type) == (REPO, "model")
    refs = {ref for rev in repo.revisions for ref in rev.refs}
    assert refs == {"main", "v1"} and {rev.commit_hash for rev in repo.revisions} == {OLD, NEW}


def test_hub_id_loads_from_the_cache_offline(cached_model, hf_home):
    assert is_hub_id(REPO)
    assert resolve_model(REPO) == hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / (
        f"snapshots/{NEW}"
    )
    assert _same_weights(load_model(REPO), cached_model[NEW])
    tok, preset = load_tokenizer(REPO), build_char_tokenizer()
    assert tok.encode("12 + 30\n") == preset.encode("12 + 30\n")
    assert tok.padding_side == "left" and tok.chat_template == preset.chat_template


@pytest.mark.parametrize("revision", [OLD, "v1"])
def test_pinned_revision_by_commit_or_ref(cached_model, revision):
    assert resolve_model(REPO, revision=revision).name == OLD
    assert _same_weights(load_model(REPO, revision=revision), cached_model[OLD])
    assert load_tokenizer(REPO, revision=revision).eos_token == "<|im_end|>"


def test_repo_with_pytorch_weights_only(hf_home, tmp_path):
    model = _export(tmp_path / "bin", seed=4)
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    _cache_model(hf_home / "hub", "nebula-test/old-format", tmp_path / "bin", OLD, ["main"])
    assert _same_weights(load_model("nebula-test/old-format"), model)


@pytest.mark.parametrize(
    ("name", "revision"), [("nebula-test/absent", None), (REPO, "v9"), (REPO, "c" * 40)]
)
def test_missing_model_offline_is_a_clear_error(cached_model, hf_home, name, revision):
    with pytest.raises(ValueError) as err:
        load_model(name, revision=revision)
    said = str(err.value)
    assert said.startswith(f"policy.model_name_or_path: {name} (revision {revision or 'main'})")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in said
    assert str(hf_home / "hub") in said and f"`hf download {name}" in said


@pytest.mark.parametrize(
    "name", ["bare-name", "a/b/c", "owner/na--me", "owner/name.git", "own er/name", "/abs/x"]
)
def test_malformed_ids_are_refused(hf_home, name):
    assert not is_hub_id(name)
    with pytest.raises(ValueError, match="neither a local folder nor a Hugging Face Hub id"):
        load_tokenizer(name)
    with pytest.raises(ValueError, match=r"policy\.model_name_or_path: empty"):
        load_model("")


def test_hub_ids_are_owner_slash_name_and_not_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here" / "there").mkdir(parents=True)
    names = [REPO, DATASET, "openai/gsm8k", "bare", "a/b/c", "x/y--z", "builtin:a", "here/there"]
    assert [is_hub_id(n) for n in names] == [True] * 3 + [False] * 5


def test_local_folder_wins_over_an_id_looking_name(cached_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = _export(tmp_path / REPO, seed=3)
    assert not is_hub_id(REPO)
    assert resolve_model(REPO) == Path(REPO)
    assert _same_weights(load_model(REPO), local)
    (tmp_path / "nebula-test" / "no-config").mkdir()
    with pytest.raises(ValueError, match=r"policy.model_name_or_path: .*no-config has no config"):
        load_model("nebula-test/no-config")


def test_env_variables_alone_work_in_a_fresh_process(cached_model, hf_home):
    script = (
        "from nebula_rl.models import load_model, load_tokenizer\n"
        f"print(load_model({REPO!r}, revision='v1').config.vocab_size)\n"
        f"print(load_tokenizer({REPO!r}).decode([5, 6]) == '\\n ')\n"
        "try:\n"
        "    load_model('nebula-test/absent')\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, **_env(hf_home), "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    vocab, decoded, error = out.stdout.splitlines()[-3:]
    assert int(vocab) == cached_model[OLD].config.vocab_size and decoded == "True"
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in error


def _cache_dataset(hf_home: Path, tmp_path: Path, repo_id: str, subsets: dict) -> None:
    """Prepare `repo_id` in the datasets cache as an online `load_dataset(repo_id, subset)` leaves
    it, which is all `load_dataset` reads offline:
    `<HF_HOME>/datasets/<owner>___<name>/<subset>/0.0.0/<commit>/{dataset_info.json,
    <name>-<split>.arrow}`. datasets itself writes it, from a local copy of the repo (a README
    declaring the subsets, a JSON lines file per split) named like the repo; only the folder
    names it cannot know (the owner and the commit) are set afterwards."""
    owner, name = repo_id.split("/")
    repo = tmp_path / "repo" / name
    card = ["---", "configs:"]
    for subset, splits in subsets.items():
        card += [f"- config_name: {subset}", "  data_files:"]
        for split, rows in splits.items():
            (repo / subset).mkdir(parents=True, exist_ok=True)
            (repo / subset / f"{split}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows)
            )
            card += [f"  - split: {split}", f"    path: {subset}/{split}.jsonl"]
    (repo / "README.md").write_text("\n".join([*card, "---", ""]))
    for subset in subsets:
        datasets.load_dataset_builder(str(repo), subset).download_and_prepare()
    cache = hf_home / "datasets"
    (cache / name).rename(cache / f"{owner}___{name}")
    for prepared in (cache / f"{owner}___{name}").glob("*/*/*"):
        if prepared.is_dir():
            prepared.rename(prepared.with_name(NEW))


EASY = {"train": [{"prompt": "1+1=", "answer": "2"}], "test": [{"prompt": "2+2=", "answer": "4"}]}
HARD = {"train": [{"prompt": "9*9=", "answer": "81"}, {"prompt": "7*8=", "answer": "56"}]}


@pytest.fixture
def cached_dataset(hf_home, tmp_path):
    _cache_dataset(hf_home, tmp_path, DATASET, {"easy": EASY, "hard": HARD})


def test_hub_dataset_subset_and_splits_offline(cached_dataset):
    ds = DatasetConfig(name=DATASET, subset="easy", split=["test", "train"])
    assert load_rows(ds) == EASY["test"] + EASY["train"]
    assert load_rows(DatasetConfig(name=DATASET, subset="hard")) == HARD["train"]


def test_offline_dataset_revision_cannot_be_checked(cached_dataset, caplog):
    # Offline, datasets 5.2 serves its latest prepared copy and ignores the revision (its
    # CachedDatasetModuleFactory never reads it); nebula-rl says so rather than pretend.
    rows = load_hub_rows(DATASET, subset="hard", revision=OLD, splits=["train"])
    assert rows == HARD["train"]
    assert "whatever its revision" in caplog.text


@pytest.mark.parametrize(
    ("name", "subset", "split", "why"),
    [
        ("nebula-test/absent", "", "train", "HF_HUB_OFFLINE=1 forbids downloading it"),
        (DATASET, "nope", "train", "Couldn't find cache for nebula-test/tiny-math for config"),
        (DATASET, "hard", "test", 'Unknown split "test"'),
    ],
)
def test_missing_dataset_offline_is_a_clear_error(cached_dataset, name, subset, split, why):
    with pytest.raises(ValueError) as err:
        load_rows(DatasetConfig(name=name, subset=subset, split=split, revision="v1"))
    said = str(err.value)
    assert said.startswith(f"dataset.name: {name} (subset {subset or 'default'}, revision v1)")
    assert why in said


def test_malformed_dataset_name_is_refused(hf_home):
    with pytest.raises(ValueError, match="does not exist, and it is not a Hugging Face Hub"):
        load_rows(DatasetConfig(name="no/such/folder"))


def test_local_dir_is_read_instead_of_the_hub(hf_home):
    ds = DatasetConfig(name="openai/gsm8k", split="test")
    ds = ds.model_copy(update={"local_dir": str(GSM8K)})
    rows = load_rows(ds)
    assert len(rows) == 1319 and "####" in rows[0]["answer"]
    with pytest.raises(ValueError, match=r"dataset\.local_dir: .*missing"):
        load_hub_rows("openai/gsm8k", subset="", revision="", splits=["test"], local_dir="missing")


def test_a_unified_cosmos3_checkpoint_loads_its_reasoner(tmp_path):
    """`nvidia/Cosmos3-Nano`'s layout: a diffusers pipeline whose root config, tokenizer and
    safetensors index serve transformers, the index naming weight files in `transformer/`
    (the language model with the generator's tensors beside it, keys flat and attention named
    the diffusers way) and `vision_encoder/` (the vision tower). Fetched from a Hub (served
    locally): the root files and the weights the index names come down, not the pipeline's other
    weights (its VAE), and the reasoner loads with the weights it was cut from, the generator's
    tensors dropped."""
    from safetensors.torch import save_file

    from fake_hub import FakeHub
    from nebula_rl.data.vision import VisionProcessor

    model = load_model("tiny:cosmos3_omni", seed=3)
    folder = tmp_path / "unified"
    folder.mkdir()
    model.config.save_pretrained(folder)
    VisionProcessor.from_pretrained("tiny:cosmos3_omni").save_pretrained(folder)
    parts: dict[str, dict[str, torch.Tensor]] = {"transformer": {}, "vision_encoder": {}}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.visual."):
            parts["vision_encoder"][name.removeprefix("model.visual.")] = tensor.clone()
        else:
            flat = name.removeprefix("model.language_model.").replace(".q_proj.", ".to_q.")
            parts["transformer"][flat.replace(".o_proj.", ".to_out.")] = tensor.clone()
    width = model.config.text_config.hidden_size
    parts["transformer"]["layers.0.self_attn.add_q_proj.weight"] = torch.randn(width, width)
    parts["transformer"]["proj_in.weight"] = torch.randn(width, 16)
    weight_map = {}
    for sub, tensors in parts.items():
        (folder / sub).mkdir()
        file = f"{sub}/diffusion_pytorch_model.safetensors"
        save_file(tensors, folder / file)
        weight_map |= dict.fromkeys(tensors, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "Cosmos3OmniPipeline"}))
    (folder / "vae").mkdir()
    save_file(
        {"decoder.weight": torch.zeros(4)}, folder / "vae" / "diffusion_pytorch_model.safetensors"
    )

    repo = "nebula-test/cosmos3-unified"
    hub = FakeHub({repo: folder}, NEW)
    home = tmp_path / "hf"
    env = {**os.environ, **_env(home), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}
    code = f"from nebula_rl.models.hub import resolve_model; print(resolve_model({repo!r}))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
    finally:
        hub.close()
    assert out.returncode == 0, out.stderr
    assert "transformer/diffusion_pytorch_model.safetensors" in hub.served
    assert "vision_encoder/diffusion_pytorch_model.safetensors" in hub.served
    assert "vae/diffusion_pytorch_model.safetensors" not in hub.served
    loaded = load_model(out.stdout.strip())
    assert type(loaded).__name__ == "Cosmos3OmniForConditionalGeneration"
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
