"""World models (`policy.is_diffusers`): flow (diffusion) transformers that generate clips with a
sampler that records log-probabilities, trained by FlowGRPO, DDRL, DiffusionNFT or flow SFT."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nebula_rl.config import Config, GrpoConfig
from nebula_rl.modality.base import Modality, Report
from nebula_rl.utils.hub import is_hub_id

if TYPE_CHECKING:
    import torch

    from nebula_rl.controller.client import ReplicaSession
    from nebula_rl.controller.run import JobRows

__all__ = ["World"]


class World(Modality):
    name = "world"

    def fetched_datasets(self) -> frozenset[str]:
        from nebula_rl.flow.prompts import PROMPT_SETS

        return frozenset(PROMPT_SETS)  # (cosmos-rl's prompt sets: fetched at launch)

    def check_single(self, cfg: Config) -> None:
        from nebula_rl.flow.job import check_ranks

        check_ranks(cfg)

    def run_single(self, cfg: Config) -> Path:
        from nebula_rl.flow import job

        return job.run(cfg)

    def check_job(self, cfg: Config) -> None:
        from nebula_rl.flow.runtime import check_flow_job

        check_flow_job(cfg)

    def run_policy(self, session: ReplicaSession, *, device: torch.device) -> None:
        from nebula_rl.flow.runtime import flow_policy

        if session.cfg.mode == "colocated":
            from nebula_rl.flow.colocated import WorldRounds
            from nebula_rl.policy.colocated import run_colocated

            run_colocated(session, device=device, rounds=WorldRounds, build=flow_policy)
            return
        from nebula_rl.policy.worker import run_policy

        run_policy(session, device=device, build=flow_policy)

    def run_rollout(self, session: ReplicaSession, *, device: torch.device) -> None:
        from nebula_rl.flow.runtime import run_flow_rollout

        run_flow_rollout(session, device=device)

    def job_rows(self, cfg: Config, run_dir: Path) -> JobRows:
        """The job's clips, listed without torch (every replica reads them from its own copy,
        so prompts carry no text), and its trajectory files."""
        from nebula_rl.controller.run import JobRows
        from nebula_rl.flow.clips import world_rows
        from nebula_rl.flow.trajectories import TrajectoryStore

        return JobRows(
            world_rows(cfg, run_dir),
            world_rows(cfg, run_dir, validation=True) if cfg.validation.enable else [],
            side_files=TrajectoryStore.for_job(run_dir),
            with_text=False,
            sample_lengths=False,
        )

    def check_layout(
        self, cfg: Config, report: Report, *, num_policy: int, num_rollout: int
    ) -> None:
        _check_model(cfg, report)
        par = cfg.policy.parallelism
        shards = par.dp_shard_size * par.dp_replicate_size
        split = (
            f"HSDP: {par.dp_replicate_size} copies of {par.dp_shard_size} shard(s)"
            if par.dp_replicate_size > 1
            else "FSDP2-sharded"
        )
        p = cfg.train.train_policy
        rl = isinstance(p, GrpoConfig)
        if not isinstance(p, GrpoConfig) or (cfg.mode == "colocated" and p.uncentralized_training):
            report.notes.append(
                f"layout: the world model trains on {shards} rank(s), {split}"
                + (", sampling its own rollouts in this job (uncentralized)" if rl else "")
                + " (docs/world-models.md)"
            )
        elif cfg.mode == "colocated":
            report.notes.append(
                f"layout: world-model RL runs {num_policy} colocated policy replica(s) of "
                f"{shards} process(es) ({split}), each rank also sampling, no rollout replicas "
                "(docs/colocated.md)"
            )
        else:
            report.notes.append(
                f"layout: world-model RL runs {num_policy} policy replica(s) of {shards} "
                f"process(es) ({split}) and {num_rollout} rollout replica(s) of one (`--local`: all in "
                "this one process; docs/world-models.md)"
            )


def _check_model(cfg: Config, p: Report) -> None:
    """A world model on disk or a preset is checked here (its class, its pixel space); a Hub
    model's configs are fetched and checked at launch."""
    from nebula_rl.flow.diffusers_models import DIFFUSERS_CLASSES
    from nebula_rl.flow.models import check_flow_model
    from nebula_rl.flow.vae import VAE_CLASSES

    name = cfg.policy.model_name_or_path
    if Path(name).exists() or name.startswith("tiny:"):
        try:
            check_flow_model(cfg)
        except ValueError as err:
            p.errors.append(str(err))
    elif is_hub_id(name):
        p.notes.append(
            f"policy.model_name_or_path: {name} is fetched from the Hub at launch; its "
            f"transformer must be a {' / '.join(DIFFUSERS_CLASSES)}, in pixel space "
            f"(in_channels = 3) or with its pipeline's {' / '.join(VAE_CLASSES)} in vae/"
        )
