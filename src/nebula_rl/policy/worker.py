"""Policy replica: train on the batches the controller schedules, push weights to the rollouts.

The loop reads commands from the job's `commands` stream:

- `train`: take the in-flight batch, run one step of the configured algorithm
  (:meth:`~nebula_rl.policy.trainer.PolicyTrainer.grpo_step`: advantages, loss, `mu_iterations`
  passes in `mini_batch` chunks), then, when told to, snapshot the weights into the weight
  sender's buffers and return at once: the broadcast to the rollouts runs in a background thread
  while the next step trains. The result (metrics) goes to the `results` stream, then the command
  is acknowledged.
- `stop`: wait for the last weight push and checkpoint, export the model as a Hugging Face
  folder, confirm.

A `train` command may ask for a checkpoint after its step (policy rank 0 writes it; the
replicas are identical). With `meta["resume_from"]` every replica loads that checkpoint first and
acknowledges, without training, the commands of steps it already covers.

Several policy replicas form one data-parallel policy: each trains its share of the step's
batch, gradients are summed across replicas (:class:`~nebula_rl.policy.replicas.ReplicaGroup`)
and rank 0 alone pushes weights and exports.

Simplification: one process per policy replica here (data, tensor and pipeline parallelism inside
a replica come with the parallelism work); the full state is pushed, not shards.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.local import export_hf
from nebula_rl.models import load_model, load_tokenizer, resolve_dtype
from nebula_rl.policy.checkpoint import Checkpointer
from nebula_rl.policy.replicas import ReplicaGroup
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.weights import Rendezvous, WeightSender, build_group

__all__ = ["run_policy"]

log = logging.getLogger(__name__)


def run_policy(session: ReplicaSession, *, device: torch.device) -> None:
    """Body of a policy replica process."""
    cfg, state, meta = session.cfg, session.state, session.meta
    p = cfg.grpo
    path = cfg.policy.model_name_or_path
    rank = session.registration["policy_rank"]
    backend: Literal["gloo", "nccl"] = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=10)
    tokenizer = load_tokenizer(path)
    # Every replica loads the same weights with the same seed, so they start identical.
    model = load_model(
        path, dtype=resolve_dtype(cfg.train.param_dtype), device=device, seed=cfg.train.seed or 0
    )
    ref = copy.deepcopy(model).eval().requires_grad_(False) if p.kl_beta > 0 else None
    replicas = None
    if meta["policy_group"]["world_size"] > 1:
        group = build_group(
            Rendezvous(**meta["policy_group"]), rank=rank, backend=backend, timeout=timeout
        )
        replicas = ReplicaGroup(group)
    trainer = PolicyTrainer(
        model,
        cfg,
        total_steps=meta["total_steps"],
        pad_id=tokenizer.pad_token_id,
        ref_model=ref,
        replicas=replicas,
    )
    checkpointer = Checkpointer(
        cfg.train.ckpt,
        Path(meta["run_dir"]),
        model=model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        export=functools.partial(export_hf, model, tokenizer),
    )
    version = 0
    if meta["resume_from"] is not None:  # every replica loads it: they stay identical
        version = checkpointer.load(Path(meta["resume_from"])).step
    session.policy_version = lambda: version
    session.start_heartbeats()

    sender = None
    if rank == 0:  # the weight sender: rank 0 of the weight group
        weights = build_group(
            Rendezvous(**meta["weights"]), rank=0, backend=backend, timeout=timeout
        )
        transfer = cfg.train.transfer_dtype
        sender = WeightSender(
            weights,
            model.named_parameters(),
            transfer_dtype=resolve_dtype(transfer) if transfer else None,
        )
        sender.push(model.named_parameters(), version)  # the rollouts start from exactly these
    while session.finished() is None:
        for msg_id, command in state.read_commands(session.name, block_ms=500):
            if command["type"] == "train" and command["step"] <= version:
                pass  # trained before the checkpoint this replica resumed from
            elif command["type"] == "train":
                by_id = {g.prompt.prompt_id: g for g in state.inflight_batch()}
                missing = [i for i in command["prompt_ids"] if i not in by_id]
                if missing:
                    raise RuntimeError(f"step {command['step']}: {missing} are not in flight")
                start = time.perf_counter()
                metrics = trainer.grpo_step([by_id[i] for i in command["prompt_ids"]])
                train_time = time.perf_counter() - start
                version = command["step"]
                if command["push_weights"]:
                    assert sender is not None, "only policy rank 0 pushes weights"
                    sender.push(model.named_parameters(), command["step"])
                if command["checkpoint"]:
                    checkpointer.save(command["step"], data={})
                state.push_result(
                    {
                        "type": "train",
                        "rank": rank,
                        "step": command["step"],
                        "prompt_ids": command["prompt_ids"],
                        "metrics": metrics,
                        "train_time": train_time,
                    }
                )
            elif command["type"] == "stop":
                checkpointer.close()
                if sender is not None:
                    sender.close()
                if rank == 0 and cfg.train.ckpt.export_safetensors:
                    export = Path(meta["run_dir"]) / "safetensors" / "final"
                    export_hf(model, tokenizer, export)
                    log.info("exported the final weights to %s", export)
                if replicas is not None:
                    replicas.close()
                state.push_result({"type": "stopped", "rank": rank})
                state.ack_command(session.name, msg_id)
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            state.ack_command(session.name, msg_id)
