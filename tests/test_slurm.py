"""`nebula-rl slurm`: the sbatch script's layout and secrets, and a whole job run by the script
against fake `sbatch` / `srun` / `scontrol` that run everything on this machine."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nebula_rl.cli import main
from nebula_rl.config import Config, config_from_dict
from nebula_rl.controller.client import REDIS_URL_ENV, TOKEN_ENV
from nebula_rl.launch.slurm import SlurmJob, place_on_nodes, render_sbatch


def _gpu_job(tmp_path: Path, policy: dict, rollout: dict, mode: str = "disaggregated") -> Config:
    return config_from_dict(
        {
            "mode": mode,
            "train": {
                "output_dir": str(tmp_path / "out"),
                "train_policy": {"type": "grpo", "dataset": {"name": "builtin:arithmetic"}},
            },
            "policy": {"model_name_or_path": "tiny:qwen2", "parallelism": policy},
            "rollout": {"parallelism": rollout},
        },
        source="test",
    )


def _srun_lines(script: str) -> dict[str, tuple[int, str, int]]:
    """replica name -> (node index, CUDA_VISIBLE_DEVICES or "", --nproc), from its srun."""
    found = {}
    for match in re.finditer(
        r'srun --nodes=1 --ntasks=1 --nodelist="\$\{NODES\[(\d+)\]\}" --overlap \\\n'
        r"\s+(?:env CUDA_VISIBLE_DEVICES=([\d,]+) )?\"\$PYTHON\" -m nebula_rl.cli replica "
        r'--role (\w+) --controller "\$CONTROLLER" \\\n\s+--name ([\w-]+) --nproc (\d+)',
        script,
    ):
        node, devices, role, name, nproc = match.groups()
        assert name.startswith(role)
        found[name] = (int(node), devices or "", int(nproc))
    return found


def test_two_node_script_places_the_controller_on_node_0_and_each_replica_on_its_gpus(
    tmp_path: Path,
) -> None:
    cfg = _gpu_job(tmp_path, {"dp_shard_size": 4, "n_init_replicas": 1}, {"n_init_replicas": 4})
    job = SlurmJob(
        config_path=tmp_path / "job.toml",
        num_nodes=2,
        gpus_per_node=4,
        partition="batch",
        account="rl",
        time="04:00:00",
        job_name="grpo",
        workdir=tmp_path,
    )
    script = render_sbatch(cfg, job)
    for header in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=batch",
        "#SBATCH --account=rl",
        "#SBATCH --time=04:00:00",
        "#SBATCH --job-name=grpo",
        f"#SBATCH --output={tmp_path}/out/slurm-%j.log",
    ):
        assert header + "\n" in script
    assert _srun_lines(script) == {
        "policy-0": (0, "0,1,2,3", 4),
        "rollout-0": (1, "0", 1),
        "rollout-1": (1, "1", 1),
        "rollout-2": (1, "2", 1),
        "rollout-3": (1, "3", 1),
    }
    assert script.count("srun ") == 5
    # The controller runs in the batch script itself (node 0), bound to node 0's address, after
    # the first node of the allocation was named; the replicas wait for its /health.
    controller = script.index("-m nebula_rl.cli controller")
    assert script.index("scontrol show hostnames") < controller < script.index("srun ")
    assert '--host "$HEAD_ADDR"' in script and "bind $HEAD_ADDR" in script
    assert script.index("/health") < script.index("srun ")
    assert "#   node 0: controller + Redis; policy-0" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_the_script_holds_no_secret_and_passes_them_through_the_environment(
    tmp_path: Path,
) -> None:
    cfg = _gpu_job(tmp_path, {"n_init_replicas": 1}, {"n_init_replicas": 1})
    script = render_sbatch(cfg, SlurmJob(config_path=tmp_path / "job.toml", num_nodes=1))
    # Made when the job runs, in variables; on no command line (srun passes the environment).
    assert f"export {TOKEN_ENV}\n{TOKEN_ENV}=$(secret)" in script
    assert "REDIS_PASSWORD=$(secret)" in script
    assert f"{REDIS_URL_ENV}=$REDIS_URL " in script  # the controller's environment
    assert "token_urlsafe" in script  # (the generator, not a value)
    assert not re.search(r"[A-Za-z0-9_-]{43}", script)  # no token_urlsafe(32) value
    for line in script.splitlines():
        if "srun" in line or "nebula_rl.cli" in line:
            assert "TOKEN" not in line and "PASSWORD" not in line, line


def test_colocated_rollouts_share_their_policy_replicas_node_and_gpus(tmp_path: Path) -> None:
    cfg = _gpu_job(
        tmp_path,
        {"dp_shard_size": 4},
        {"tp_size": 2},
        mode="colocated_separated",
    )
    placed = place_on_nodes(cfg, num_policy=2, num_rollout=4, num_nodes=2, gpus_per_node=4)
    where = {p.name: (node, p.devices) for node, p in placed}
    assert where == {
        "policy-0": (0, (0, 1, 2, 3)),
        "policy-1": (1, (0, 1, 2, 3)),
        "rollout-0": (0, (0, 1)),
        "rollout-1": (1, (0, 1)),
        "rollout-2": (0, (2, 3)),
        "rollout-3": (1, (2, 3)),
    }


def test_cpu_replicas_take_the_nodes_in_turn(tmp_path: Path) -> None:
    cfg = _gpu_job(tmp_path, {}, {})
    placed = place_on_nodes(cfg, num_policy=1, num_rollout=3, num_nodes=2, gpus_per_node=0)
    assert [(node, p.name, p.devices) for node, p in placed] == [
        (0, "policy-0", ()),
        (1, "rollout-0", ()),
        (0, "rollout-1", ()),
        (1, "rollout-2", ()),
    ]


@pytest.mark.parametrize(
    ("policy", "rollout", "num_rollout", "words"),
    [
        # a replica larger than a node
        ({"dp_shard_size": 6}, {}, 1, ["policy-0 needs 6 GPUs", "policy.parallelism", "--gpus-per-node"]),
        # more GPUs than the allocation
        ({"dp_shard_size": 4}, {"tp_size": 2}, 4, ["needs 12 GPUs", "--nodes 2 x --gpus-per-node 4"]),
        # enough GPUs in all, but not whole replicas per node
        ({"dp_shard_size": 3, "n_init_replicas": 2}, {"tp_size": 2}, 1,
         ["do not fit whole on 2 node(s)", "policy-1 3", "--nodes"]),
    ],
)  # fmt: skip
def test_layouts_that_do_not_fit_the_nodes_are_refused_naming_keys_and_flags(
    tmp_path: Path, policy: dict, rollout: dict, num_rollout: int, words: list[str]
) -> None:
    cfg = _gpu_job(tmp_path, policy, rollout)
    job = SlurmJob(
        config_path=tmp_path / "job.toml", num_nodes=2, gpus_per_node=4, num_rollout=num_rollout
    )
    with pytest.raises(ValueError) as err:
        render_sbatch(cfg, job)
    for word in words:
        assert word in str(err.value)


def test_cli_refuses_a_bad_flag_and_writes_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.json"
    config.write_text(_gpu_job(tmp_path, {}, {}).model_dump_json())
    assert main(["slurm", "--config", str(config), "--nodes", "1", "--time", "4 hours"]) == 2
    assert "--time '4 hours'" in capsys.readouterr().err
    out = tmp_path / "job.sbatch"
    assert main(["slurm", "--config", str(config), "--nodes", "1", "--out", str(out)]) == 0
    assert out.read_text().startswith("#!/bin/bash\n#SBATCH --job-name=nebula-rl\n")


_FAKES = {
    # `scontrol show hostnames LIST`: one name a line (the fake's LIST: comma-separated names).
    "scontrol": """\
[[ $1 == show && $2 == hostnames ]] || exit 1
tr ',' '\\n' <<< "$3"
""",
    # srun: drops its options and runs the command here, as the step would on --nodelist.
    "srun": """\
node=""
while [[ $1 == --* ]]; do
    [[ $1 == --nodelist=* ]] && node=${1#--nodelist=}
    shift
done
echo "$node $*" >> "$FAKE_SLURM/srun.log"
exec "$@"
""",
    # sbatch --parsable FILE: runs FILE as Slurm would on the first of two nodes (until it
    # ends: the test waits for the job), then prints the job id.
    "sbatch": """\
script=${!#}
SLURM_JOB_ID=4242 SLURM_JOB_NODELIST=nodea,nodeb SLURM_NNODES=2 NEBULA_HEAD_ADDR=127.0.0.1 \\
    bash "$script" > "$FAKE_SLURM/job.log" 2>&1
echo $? > "$FAKE_SLURM/job.exit"
echo "4242"
""",
}


@pytest.mark.slow
def test_the_script_runs_a_job_to_its_end_on_fake_slurm(tmp_path: Path, grpo_job_config) -> None:
    """`nebula-rl slurm --submit` with fake Slurm commands first on PATH: Redis, the controller
    and a replica per node run here; the job trains its steps and exits 0."""
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, body in _FAKES.items():
        path = fakes / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    cfg = grpo_job_config(num_rows=8, groups=2)
    config = tmp_path / "job.json"
    config.write_text(cfg.model_dump_json())
    env = {
        **os.environ,
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "slurm", "--config", str(config), "--nodes", "2"]
        + ["--gpus-per-node", "0", "--out", str(tmp_path / "job.sbatch"), "--submit"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    run_dir = tmp_path / "out" / "run"
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}"
        for p in [tmp_path / "job.log", *sorted(run_dir.glob("logs/*.log"))]
        if p.exists()
    )
    assert done.returncode == 0, f"{done.stderr}\n{logs}"
    assert done.stdout.strip() == "4242"
    assert (tmp_path / "job.exit").read_text().strip() == "0", logs
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "policy_version" in m] == [1, 2, 3, 4]
    assert (run_dir / "safetensors" / "final").is_dir()
    # One step per replica, on its node; the token (which they needed) is in no script or argv.
    sruns = (tmp_path / "srun.log").read_text().splitlines()  # (in either order: both at once)
    nodes = {re.search(r"--name (\S+)", line)[1]: line.split()[0] for line in sruns}
    assert nodes == {"policy-0": "nodea", "rollout-0": "nodeb"}
    token = (run_dir / "token").read_text().strip()
    assert oct((run_dir / "token").stat().st_mode & 0o777) == "0o600"
    assert token not in (tmp_path / "job.sbatch").read_text() and token not in "".join(sruns)
    assert "job finished" in (tmp_path / "job.log").read_text()
