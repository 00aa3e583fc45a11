"""Language and vision-language models: the engines generate text, the policy trains the
GRPO family, SFT and distillation on token sequences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nebula_rl.config import Config, GrpoConfig
from nebula_rl.modality.base import Modality, Report
from nebula_rl.utils.devices import visible_gpus

if TYPE_CHECKING:
    import torch

    from nebula_rl.controller.client import ReplicaSession
    from nebula_rl.controller.run import JobRows

__all__ = ["Text"]


class Text(Modality):
    name = "text"

    def check_single(self, cfg: Config) -> None:
        pass  # (SFT and `--local` RL take the model's split from policy.parallelism as it is)

    def run_single(self, cfg: Config) -> Path:
        from nebula_rl import local

        return local.run(cfg)

    def check_job(self, cfg: Config) -> None:
        from nebula_rl.models import load_model_config, load_tokenizer
        from nebula_rl.policy.parallelize import ParallelDims
        from nebula_rl.policy.setup import check_pipeline_micro_batches
        from nebula_rl.rollout.build import check_backend

        check_backend(cfg.rollout)
        # (raises naming the key and the path)
        load_tokenizer(cfg.policy.model_name_or_path, revision=cfg.policy.model_revision)
        if cfg.distillation.enable:
            from nebula_rl.policy.teacher import check_teacher

            check_teacher(cfg)
        par = cfg.policy.parallelism
        others = par.pp_size * par.dp_replicate_size * par.cp_size * par.tp_size
        dims = ParallelDims.from_config(par, world_size=par.world_size or others)
        check_pipeline_micro_batches(cfg, dims)
        config = load_model_config(
            cfg.policy.model_name_or_path, revision=cfg.policy.model_revision
        )
        # (tp_size must divide the heads, pp_size not exceed the layers; models load with SDPA)
        config._attn_implementation = config._attn_implementation or "sdpa"
        dims.check_model(config)

    def run_policy(self, session: ReplicaSession, *, device: torch.device) -> None:
        if session.cfg.mode == "colocated":
            from nebula_rl.policy.colocated import run_colocated
            from nebula_rl.rollout.colocated import TextRounds

            run_colocated(session, device=device, rounds=TextRounds)
            return
        from nebula_rl.policy.worker import run_policy

        run_policy(session, device=device)

    def run_rollout(self, session: ReplicaSession, *, device: torch.device) -> None:
        from nebula_rl.rollout.text import run_rollout

        run_rollout(session, device=device)

    def job_rows(self, cfg: Config, run_dir: Path) -> JobRows:
        from nebula_rl.controller.run import text_rows

        return text_rows(cfg, run_dir)

    def check_layout(
        self, cfg: Config, report: Report, *, num_policy: int, num_rollout: int
    ) -> None:
        _check_heads(cfg, report)
        _layout(cfg, num_policy, num_rollout, report)


def _local_model_config(cfg: Config) -> dict[str, Any] | None:
    """The config.json of a local model folder (None for presets, Hub ids, missing folders)."""
    path = Path(cfg.policy.model_name_or_path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data.get("text_config", data) if isinstance(data, dict) else None


def _check_heads(cfg: Config, p: Report) -> None:
    """Tensor parallel sizes must divide a local model's attention heads."""
    policy, rollout = cfg.policy.parallelism, cfg.rollout.parallelism
    model = _local_model_config(cfg)
    if model is None:
        return
    for size_key, size in (("tp_size", policy.tp_size), ("tp_size", rollout.tp_size)):
        for dim in ("num_attention_heads", "num_key_value_heads"):
            count = model.get(dim)
            if isinstance(count, int) and size > 1 and count % size:
                which = "policy" if size == policy.tp_size else "rollout"
                p.errors.append(
                    f"{which}.parallelism.{size_key} ({size}) must divide the model's {dim} "
                    f"({count})"
                )


def _layout(cfg: Config, num_policy: int, num_rollout: int, p: Report) -> None:
    """The devices the replicas need, against those this machine shows."""
    policy, rollout = cfg.policy.parallelism, cfg.rollout.parallelism
    rl = isinstance(cfg.train.train_policy, GrpoConfig)
    policy_world = policy.world_size
    rollout_world = rollout.world_size if rl else 0
    if policy_world is not None:
        dp = policy.dp_replicate_size * policy.dp_shard_size
        samples = cfg.groups_per_replica * cfg.rollout.n_generation if rl else 1
        if rl and samples < dp:
            p.errors.append(
                f"train.train_batch_per_replica ({cfg.train.train_batch_per_replica}) gives "
                f"{samples} completions per policy replica, fewer than its {dp} data-parallel "
                "ranks: every rank needs at least one"
            )
    if policy_world is None:
        p.notes.append(
            "policy.parallelism.dp_shard_size = -1: each policy replica takes the devices the "
            "launcher gives it"
        )
        return
    # (mode = "colocated_separated": the rollout replicas run on the policy replicas' GPUs)
    shared = rl and cfg.mode == "colocated_separated"
    rollout_ranks = rollout_world or 0
    need = num_policy * policy_world + (0 if shared else num_rollout * rollout_ranks)
    parts = f"policy {num_policy} x {policy_world}"
    if rl and cfg.mode == "colocated":  # (no rollout replicas: num_rollout is 0)
        parts += ", every rank also generating: colocated"
    elif rl:
        parts += f" + rollout {num_rollout} x {rollout_world}"
    if rl and cfg.distillation.enable:
        teacher = cfg.distillation.parallelism
        num_teacher = teacher.n_init_replicas
        need += num_teacher
        parts += f" + teacher {num_teacher} x 1"
        if teacher.world_size != 1:
            p.notes.append(
                "distillation.parallelism: each teacher replica runs whole in one process "
                "(a split teacher is not built yet: `nebula-rl train` refuses sizes above 1; "
                "scale the teacher with n_init_replicas)"
            )
    if shared:
        p.notes.append(
            f"layout: {need} device(s) ({parts}, the rollout replicas on the policy replicas' "
            f'GPUs: mode = "colocated_separated"), or {need + num_rollout * rollout_ranks} '
            "CPU processes"
        )
        if rollout_ranks > policy_world:
            p.errors.append(
                f'mode = "colocated_separated": a rollout replica (rollout.parallelism.tp_size '
                f"* pp_size = {rollout_ranks}) must fit in the GPUs of one policy replica "
                f"(policy.parallelism: {policy_world})"
            )
    else:
        p.notes.append(f"layout: {need} device(s) or CPU processes ({parts})")
    gpus = visible_gpus()
    if gpus is not None and need > gpus:
        p.errors.append(
            f"the layout needs {need} GPUs ({parts}: policy.parallelism, "
            f"rollout.parallelism, --policy/--rollout) and this machine shows {gpus}"
        )
