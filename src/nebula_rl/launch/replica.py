"""Entry of a replica's processes (`nebula-rl replica`): join the job, work, leave.

A replica of several ranks (`[policy.parallelism]`, `[rollout.parallelism]`) is that many
processes, started by :func:`nebula_rl.launch.run_ranks`. They first build their own process
group (:func:`nebula_rl.utils.ranks.init_ranks`); rank 0 then registers the replica with the controller
(with its number of ranks, so weight groups give each rank a place) and sends the heartbeats; the
other ranks read the job's config and state from the same controller and Redis, and take their
orders from rank 0 (see the policy and rollout workers).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.modality import for_config
from nebula_rl.utils.ranks import Ranks, broadcast_object, close_ranks, init_ranks, rank_env
from nebula_rl.utils.signals import forward_checkpoint_signals

__all__ = ["exit_now", "run_replica"]

log = logging.getLogger(__name__)


def _join(
    role: Literal["policy", "rollout", "teacher"], controller: str, name: str, ranks: Ranks
) -> ReplicaSession:
    """Rank 0 registers the replica; the others attach to it with rank 0's registration."""
    if ranks.world_size == 1:
        return ReplicaSession.join(controller, name=name, role=role)
    if ranks.rank == 0:
        session = ReplicaSession.join(controller, name=name, role=role, world_size=ranks.world_size)
        broadcast_object(session.registration)
        return session
    registration = broadcast_object(None)
    return ReplicaSession.attach(
        controller, name=name, role=role, registration=registration, world_size=ranks.world_size
    )


def run_replica(
    role: Literal["policy", "rollout", "teacher"], *, controller: str, name: str
) -> int:
    """Join the job at `controller` (HOST:PORT) as (a rank of) replica `name` and run `role`
    until the job ends."""
    ranks = rank_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(ranks.local_rank)
        device = torch.device("cuda", ranks.local_rank)
    else:
        device = torch.device("cpu")
    if ranks.world_size > 1:
        init_ranks("nccl" if device.type == "cuda" else "gloo")
    session = _join(role, controller, name, ranks)
    threads = None  # (a teacher: torch's default)
    if role == "policy":
        threads = session.cfg.policy.cpu_threads
    elif role == "rollout":
        threads = session.cfg.rollout.cpu_threads
    if threads is not None:
        torch.set_num_threads(threads)
    # At once, not after loading the model: a load slower than the heartbeat timeout must not
    # get the replica reaped before it starts.
    session.start_heartbeats()
    # A scheduler's pre-emption signal (train.save_ckpt_at_exit) asks for a checkpoint; the
    # replica goes on (SIGUSR1 would otherwise end it).
    forward_checkpoint_signals(session.cfg.train, session.client.request_checkpoint)
    try:
        modality = for_config(session.cfg)
        if role == "policy":
            modality.run_policy(session, device=device)
        elif role == "teacher":
            from nebula_rl.policy.teacher import run_teacher

            run_teacher(session, device=device)
        else:
            modality.run_rollout(session, device=device)
    finally:
        session.leave()
    if ranks.world_size > 1:
        close_ranks()
    log.info("replica %s done: %s", name, session.finished())
    return 0


def exit_now(code: int) -> None:
    """Flush and leave without running interpreter teardown, which can hang or abort on the
    daemon threads still blocked in a collective (the weight receiver waits for a push that
    will not come)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
