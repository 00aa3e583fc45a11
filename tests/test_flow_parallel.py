"""A world-model policy replica of two ranks (FSDP2 over the flow model, `flow.runtime`) takes the
steps of one process: every rank of a 2-rank gloo world builds the same model, shards it with
`shard_flow_model` and trains its half of the same scored trajectories with `FlowTrainer`; after
two steps the metrics and every parameter (gathered whole) must equal those of one process that
trained the whole batch.

One optimiser update per step (`mini_batch` = the samples of a rank): the mean loss over the
whole batch is then what FSDP's averaged gradients compute, whatever the split. Tolerance as in
test_parallel_grpo.py: 1e-5, while a step moves parameters by about the learning rate (1e-3).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flow_configs import tiny_flow_policy
from member_pool import MemberPool
from nebula_rl.config import ConfigError, config_from_dict
from nebula_rl.flow.data import make_toy_dataset, read_local_dataset
from nebula_rl.flow.dit import TinyDiT
from nebula_rl.flow.local import data_distance, roll_out
from nebula_rl.flow.models import load_flow_model
from nebula_rl.flow.parallel import shard_flow_model
from nebula_rl.flow.runtime import FlowTrainer, flow_settings
from nebula_rl.flow.trajectories import TrajectoryStore
from nebula_rl.flow.vae import samples_to_pixels
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.weights import free_port
from test_flow_diffusers import COSMOS_ATTENTION

TOL = 1e-5
GROUPS = 4
N = 4
STEPS = 2


def _cfg(root: Path, *, ranks: int, replicate: int = 1, cp: int = 1, **policy: object) -> object:
    return config_from_dict(_raw(root, ranks=ranks, replicate=replicate, cp=cp, **policy))


def _raw(root: Path, *, ranks: int, replicate: int = 1, cp: int = 1, **policy: object) -> dict:
    diffusers = dict(policy.pop("diffusers", {}))  # type: ignore[call-overload]
    model = str(policy.pop("model", "tiny:dit"))
    return dict(
        {
            "train": {
                "output_dir": str(root),
                "train_batch_per_replica": GROUPS * N,
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "epsilon": 1e-6,
                "optm_grad_norm_clip": 0.5,
                "train_policy": {
                    "type": "grpo",
                    "trainer_type": "flow_grpo",
                    "reward_function": "brightness",
                    "mini_batch": GROUPS * N * cp // ranks,  # (samples per data rank)
                    "epsilon_low": 1e-3,
                    "epsilon_high": 1e-3,
                    "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 1}},
                    **policy,
                },
            },
            "rollout": {"n_generation": N},
            "policy": {
                **tiny_flow_policy(model, weight_copy_decay_type=1, **diffusers),
                "parallelism": {
                    "dp_shard_size": ranks // (replicate * cp),
                    "dp_replicate_size": replicate,
                    "cp_size": cp,
                },
            },
        }
    )


def _batches(root: Path, policy: dict) -> list[list[RolloutGroup]]:
    """STEPS batches of GROUPS scored groups, their trajectories sampled by a model whose output
    layer is randomised (a fresh DiT predicts zero everywhere) and written to the store."""
    cfg = _cfg(root, ranks=1, **policy)
    d = cfg.policy.diffusers  # type: ignore[attr-defined]
    frames, size = d.inference_frames, d.inference_size[0]
    clips = read_local_dataset(
        make_toy_dataset(root / "dataset", clips_per_prompt=1, frames=frames, size=size),
        num_frames=frames,
    )
    model = _model(cfg)
    store = TrajectoryStore(root / "trajectories")
    settings = flow_settings(cfg, num_iterations=STEPS, prompts=GROUPS)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(STEPS):
        groups = []
        for k in range(GROUPS):
            index = (step * GROUPS + k) % len(clips)
            *_, t = roll_out(model, [clips[index]] * N, settings, generator)
            rewards = t.final.mean(dim=(1, 2, 3, 4)).tolist()
            prompt = Prompt(f"0:{index}", 0, index, None, None)
            completions = [Completion([], [], "", "stop", [(0, 0)], reward=r) for r in rewards]
            name = store.write(prompt.prompt_id, t)
            pixels = samples_to_pixels(model, t.final)  # (a latent model's, decoded)
            distance = data_distance(pixels, [clips[index].caption] * N, clips)
            extra = {"trajectory": name, "data_distance": distance}
            groups.append(RolloutGroup(prompt, [], completions, "rollout-0", extra))
        batches.append(groups)
    return batches


def _model(cfg: object) -> torch.nn.Module:
    model = load_flow_model(cfg, seed=1)  # type: ignore[arg-type]
    if isinstance(model, TinyDiT):
        with torch.no_grad():
            model.out.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(2))
    return model


def _train(
    root: Path,
    batches: list[list[RolloutGroup]],
    ranks: int,
    policy: dict,
    replicate: int = 1,
    cp: int = 1,
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import Replicate, Shard

    cfg = _cfg(root, ranks=ranks, replicate=replicate, cp=cp, **policy)
    clips = read_local_dataset(root / "dataset", num_frames=2)
    model = _model(cfg)
    mesh = shard_flow_model(model, torch.device("cpu"), replicate=replicate, cp=cp)
    if replicate > 1:  # (HSDP: each weight replicated over the copies, sharded within one)
        assert next(model.parameters()).placements == (Replicate(), Shard(0))
    if cp > 1:  # (the tokens split; the weights over every rank, the cp ranks sharding too)
        assert model.cp_group is not None
        if isinstance(model, TinyDiT):
            assert model.blocks[0].cp_group is model.cp_group
        weight = next(model.parameters())
        assert weight.device_mesh.size() == ranks
        assert weight.device_mesh.size(weight.device_mesh.ndim - 1) == ranks // replicate
    trainer = FlowTrainer(
        model,
        cfg,  # type: ignore[arg-type]
        clips=clips,
        store=TrajectoryStore(root / "trajectories"),
        total_steps=STEPS,
        run_dir=root,
        mesh=mesh,
    )
    history = [trainer.grpo_step(groups) for groups in batches]
    if mesh is None:
        return history, {k: v.detach().clone() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return history, get_model_state_dict(model, options=options)


def _member(
    rank: int, root: str, port: int, policy: dict, world: int = 2, replicate: int = 1, cp: int = 1
) -> tuple[list[dict], dict]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        batches = _batches_from(Path(root))
        history, params = _train(Path(root), batches, world, policy, replicate, cp)
        return history, {k: v.numpy() for k, v in params.items()}  # (rank 0's: the whole)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _batches_from(root: Path) -> list[list[RolloutGroup]]:
    import pickle

    batches: list[list[RolloutGroup]] = pickle.loads((root / "batches.pickle").read_bytes())
    return batches


@pytest.fixture(scope="module")
def members():
    pool = MemberPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def cp_members():
    """Members of their own for the context-parallel layouts: after a 4-rank HSDP mesh
    (2 x 2 x cp 1) was built and its world destroyed, the same processes hang building the
    HSDP x CP one (2 x 1 x 2); in a job each process builds one world and one mesh."""
    pool = MemberPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize(
    "policy",
    [
        {},
        {"kl_beta": 0.1},
        {"trainer_type": "ddrl", "data_beta": 0.5},
        {"trainer_type": "diffusion_nft"},  # (with weight_copy_decay_type 1)
        {"kl_beta": 0.1, "diffusers": {"max_num_conditional_frames": 1}},
        {
            "trainer_type": "ddrl",
            "data_beta": 0.5,
            "diffusers": {"min_num_conditional_frames": 1, "max_num_conditional_frames": 1},
        },
    ],
    ids=["flow_grpo", "flow_grpo_kl", "ddrl", "nft", "flow_grpo_kl-i2v", "ddrl-i2v"],
)
def test_a_two_rank_policy_replica_steps_like_one_process(members, tmp_path, policy):
    _assert_split_steps_like_one_process(members, tmp_path, policy, world=2, replicate=1)


@pytest.mark.parametrize(
    "policy", [{}, {"trainer_type": "diffusion_nft"}], ids=["flow_grpo", "nft"]
)
def test_an_hsdp_policy_replica_steps_like_one_process(members, tmp_path, policy):
    """`dp_replicate_size = 2` x `dp_shard_size = 2`: two copies of a 2-rank sharding, every
    rank with a group of its own (gradients reduce-scattered within a copy, all-reduced
    between the copies); DiffusionNFT's old weights are sharded alike."""
    _assert_split_steps_like_one_process(members, tmp_path, policy, world=4, replicate=2)


@pytest.mark.parametrize(
    ("world", "replicate", "policy"),
    [
        (2, 1, {}),
        (4, 1, {"trainer_type": "ddrl", "data_beta": 0.5}),
        (4, 2, {"trainer_type": "diffusion_nft"}),
        (2, 1, {"model": "tiny:cosmos_transformer3d"}),
        (4, 1, {"model": "tiny:wan_transformer3d", "trainer_type": "ddrl", "data_beta": 0.5}),
        (2, 1, {"model": "tiny:cosmos3_omni_generator", "diffusers": {"frames": 5, "size": 16}}),
    ],
    ids=[
        "cp2-flow_grpo",
        "fsdp2-cp2-ddrl",
        "hsdp-cp2-nft",
        "cp2-cosmos",
        "fsdp2-cp2-wan-ddrl",
        "cp2-cosmos3",
    ],
)
def test_a_context_parallel_policy_replica_steps_like_one_process(
    cp_members, tmp_path, world, replicate, policy
):
    """`cp_size = 2`: pairs of ranks share their groups and split each clip's 2 frames, one
    each (keys and values gathered in every block); alone, beside 2 FSDP2 shards, and within
    HSDP copies (with DiffusionNFT's old weights split alike); the built-in DiT, and diffusers'
    Cosmos-Predict2.5 and Wan transformers (split by `flow.context_parallel`'s hooks)."""
    _assert_split_steps_like_one_process(
        cp_members, tmp_path, policy, world=world, replicate=replicate, cp=2
    )


CP_PRESETS = [
    ("tiny:cosmos_transformer3d", False),
    ("tiny:wan_transformer3d", True),
    ("tiny:cosmos_transformer3d_latent", False),  # (conditioning frames: the mask channel)
    ("tiny:wan_transformer3d_latent", False),  # (conditioning frames: per-token timesteps)
    ("tiny:cosmos3_omni_generator", True),  # (the prompt whole on each rank; a given frame)
]


@pytest.mark.parametrize(("preset", "checkpointed"), CP_PRESETS, ids=[p for p, _ in CP_PRESETS])
def test_a_context_parallel_diffusers_transformer_computes_what_the_whole_one_does(
    members, preset, checkpointed
):
    """Two ranks split a diffusers transformer's 4 frames (2 for the latent presets), 2 each:
    each returns the whole velocity of one process, and the sum of their parameter gradients
    is the group size times one process's (FSDP2's average over the CP ranks takes it back),
    to float32's rounding of sums whose terms are large (Cosmos' learned positions: gradients
    of 1e4); the latent presets with a given frame (Cosmos' mask channel, Wan 2.2 TI2V's
    per-token timesteps, split with the tokens); with the blocks' activations recomputed in
    the backward too."""
    want, want_grads = _velocity_and_grads(preset, checkpointed)
    reports = members.run_on(range(2), _split_member, free_port(), preset, checkpointed)
    for rank, (velocity, grads) in sorted(reports.items()):
        torch.testing.assert_close(torch.from_numpy(velocity), want, rtol=0, atol=1e-6)
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            scale = float(want_grads[name].abs().max())
            torch.testing.assert_close(
                torch.from_numpy(grad) / 2, want_grads[name], rtol=0, atol=1e-4 * scale + 1e-7,
                msg=lambda m, name=name, rank=rank: f"rank {rank}, {name}: {m}",
            )  # fmt: skip


def _velocity_and_grads(
    preset: str, checkpointed: bool, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from nebula_rl.flow.diffusers_models import tiny_diffusers_flow_model
    from nebula_rl.flow.parallel import checkpoint_blocks

    latent = preset.endswith(("_latent", "_generator"))
    model = tiny_diffusers_flow_model(
        preset, frames=5 if latent else 4, size=16 if latent else 8, text_dim=32, seed=3
    )
    if checkpointed:
        checkpoint_blocks(model)
    if group is not None:
        model.context_parallel(group)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((2, 4, 2, 8, 8) if latent else (2, 3, 4, 8, 8), generator=generator)
    sigma = torch.rand(2, generator=generator)
    text = torch.randn(2, 5, 32, generator=generator)
    text_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    if model.kind == "Cosmos3OmniTransformer":  # (prompt token ids, of two lengths)
        text = model.text_encoder(["a red square", "a blue bar on the left"])
        text_mask = (text[..., 0] > 0).float()
    condition = torch.tensor([[1.0, 0.0], [0.0, 0.0]]) if model.takes_conditioning else None
    velocity = model(x, sigma, text, text_mask, condition)
    (velocity.square() * torch.linspace(0, 1, velocity.numel()).view_as(velocity)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return velocity.detach(), grads


def _split_member(
    rank: int, port: int, preset: str, checkpointed: bool
) -> tuple[object, dict[str, object]]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        velocity, grads = _velocity_and_grads(preset, checkpointed, dist.group.WORLD)
        for grad in grads.values():
            dist.all_reduce(grad)
        return velocity.numpy(), {n: g.numpy() for n, g in grads.items()}
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _assert_split_steps_like_one_process(
    members: MemberPool, root: Path, policy: dict, *, world: int, replicate: int, cp: int = 1
) -> None:
    import pickle

    batches = _batches(root, policy)
    (root / "batches.pickle").write_bytes(pickle.dumps(batches))
    want_history, want_params = _train(root, batches, 1, policy)
    reports = members.run_on(
        range(world), _member, str(root), free_port(), policy, world, replicate, cp
    )
    assert sorted(reports) == list(range(world))
    for rank, (history, params) in sorted(reports.items()):
        for step, (got, want) in enumerate(zip(history, want_history, strict=True)):
            assert got.keys() == want.keys()
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), (rank, step, key)
        if rank > 0:
            continue  # (the gathered parameters are rank 0's)
        assert params.keys() == want_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(
                torch.from_numpy(value), want_params[name], rtol=0, atol=TOL,
                msg=lambda m, name=name, rank=rank: f"rank {rank}, {name}: {m}",
            )  # fmt: skip
    start = _model(_cfg(root, ranks=1, **policy)).state_dict()
    moved = max(float((want_params[n] - p).abs().max()) for n, p in start.items())
    assert moved > 50 * TOL


def _job(tmp_path: Path, **changes: object) -> Path:
    """A small colocated world-model config (JSON) for `nebula-rl train`, with `changes`
    (dotted keys)."""
    import json

    cfg = _raw(tmp_path / "runs", ranks=2)
    cfg["mode"] = "colocated"
    cfg["train"]["timestamp"] = "colocated"
    cfg["train"]["max_num_steps"] = 3
    cfg["train"]["epoch"] = 5
    cfg["train"]["train_policy"]["dataset"]["kwargs"] = {"clips_per_prompt": 1}
    cfg["logging"] = {"multi_modal_log_interval": 3}
    for key, value in changes.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    config = tmp_path / "job.json"
    config.write_text(json.dumps(cfg))
    return config


COLOCATED_SFT: dict[str, object] = {
    "train.train_policy": {
        "type": "sft",
        "trainer_type": "diffusers_sft",
        "mini_batch": 4,
        "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 1}},
    },
    "train.train_batch_per_replica": 8,  # (of the 8 clips)
}
"""`_job`'s changes for world-model SFT on its ranks."""


def _train_cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )


@pytest.mark.parametrize(
    ("trainer", "cp", "model", "uncentralized"),
    [
        ("flow_grpo", 1, "tiny:dit", False),
        ("flow_grpo", 1, "tiny:dit", True),
        # (DiffusionNFT in the slow suite: test_flow_prompts runs it colocated on two ranks fast)
        pytest.param("diffusion_nft", 1, "tiny:dit", True, marks=pytest.mark.slow),
        ("diffusers_sft", 1, "tiny:dit", False),
        # (context parallel in the slow suite: a CP policy replica steps like one process fast)
        pytest.param("flow_grpo", 2, "tiny:dit", True, marks=pytest.mark.slow),
        pytest.param("flow_grpo", 2, "tiny:cosmos_transformer3d", True, marks=pytest.mark.slow),
        # (a LoRA policy's replica: the sampler's copy takes the adapter's weights too)
        pytest.param("flow_grpo", 1, "tiny:cosmos_transformer3d", False, marks=pytest.mark.slow),
    ],
    ids=[
        "flow_grpo", "flow_grpo-uncentralized", "diffusion_nft-uncentralized", "diffusers_sft",
        "flow_grpo-cp2-uncentralized", "flow_grpo-cp2-cosmos-uncentralized", "flow_grpo-lora-cosmos",
    ],
)  # fmt: skip
def test_colocated_runs_sample_and_train_on_the_policy_ranks(
    tmp_path, trainer, cp, model, uncentralized
):
    """`mode = "colocated"` with `dp_shard_size = 2`: one policy replica of two ranks that
    sample (RL), score and train the FSDP2-sharded model in turns, its groups through the
    controller (no rollout replica); with `uncentralized_training`, `nebula-rl train`'s own two
    ranks, without a controller. Either way the run records every step once, draws its sample
    grid on both ranks, and exports the whole model (SFT splits its batches over the same ranks;
    FlowGRPO there picks its trained steps with `train_on`, starts each group from one noise and
    resets its sharded KL reference). With `cp_size = 2` instead, the two ranks sample the same
    groups, each running one of a clip's two frames (the built-in DiT and a diffusers
    Cosmos-Predict2.5 transformer)."""
    import json

    changes: dict[str, object] = {
        "train.train_policy.trainer_type": trainer,
        "policy.model_name_or_path": model,
        "train.train_policy.uncentralized_training": uncentralized,
    }
    if cp > 1:
        changes["policy.parallelism"] = {"dp_shard_size": 1, "cp_size": cp}
    if model == "tiny:cosmos_transformer3d" and cp == 1:
        changes["policy.lora"] = {"r": 4, "lora_alpha": 8, "target_modules": COSMOS_ATTENTION}
    if trainer == "diffusers_sft":
        changes |= COLOCATED_SFT
    if trainer == "flow_grpo" and cp == 1:  # (cosmos-rl's --wfm-mode options, on shards)
        changes |= {
            "train.train_policy.kl_beta": 0.1,
            "train.train_policy.reference_reset_interval": 2,
            "policy.diffusers.train_on": [0, -1],
            "policy.diffusers.sample.same_group_noise": True,
        }
    result = _train_cli(_job(tmp_path, **changes))
    run_dir = tmp_path / "runs" / "colocated"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    key = "loss" if trainer == "diffusers_sft" else "reward_mean"
    assert all(torch.isfinite(torch.tensor(r[key])) for r in records)
    assert (run_dir / "samples" / "step_3.png").is_file()
    in_job = uncentralized or trainer == "diffusers_sft"
    assert (run_dir / "samples.png").is_file() == in_job  # (the one-job loop's last grid)
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    said = result.stdout + result.stderr
    if in_job:
        assert "[rank 1]" in said and "controller.log" not in logs
    else:  # (a colocated policy replica of two ranks under a controller, no rollout replica)
        assert logs == ["controller.log", "policy-0.log", "train.log"]
        assert "[rank 1]" in (run_dir / "logs" / "policy-0.log").read_text()
    raw = _raw(tmp_path, ranks=1)
    raw["policy"]["model_name_or_path"] = str(run_dir / "safetensors" / "final")
    trained = load_flow_model(config_from_dict(raw))
    raw["policy"]["model_name_or_path"] = model
    start = load_flow_model(config_from_dict(raw))  # (the same seed's starting weights)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(start.state_dict().values(), trained.state_dict().values(), strict=True)
    )


def test_what_colocated_mode_needs_is_refused_by_name(tmp_path):
    result = _train_cli(_job(tmp_path, mode="disaggregated"), "--local")
    assert result.returncode == 2
    said = " ".join((result.stdout + result.stderr).split())
    assert "dp_shard_size = 2: `--local` world-model RL is one process; run without" in said
    assert "uncentralized_training = true: in this job's ranks" in said
    assert "[rank 1]" not in said  # (refused before any rank started)
    with pytest.raises(ConfigError, match=r'mode = "colocated_separated": world models run'):
        config_from_dict({**_raw(tmp_path, ranks=2), "mode": "colocated_separated"})  # type: ignore[attr-defined]
    raw = _raw(tmp_path, ranks=2)
    raw["rollout"]["parallelism"] = {"dp_shard_size": 2}
    with pytest.raises(ConfigError, match=r"rollout\.parallelism\.dp_shard_size = 2: .*colocated"):
        config_from_dict(raw)
    raw["mode"] = "colocated"
    config_from_dict(raw)  # (equal to the policy's, colocated: accepted)
