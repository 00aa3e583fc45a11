"""Entry of a replica process (`nebula-rl replica`), run by torchrun: join the job, work, leave."""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.signals import forward_checkpoint_signals

__all__ = ["exit_now", "run_replica"]

log = logging.getLogger(__name__)


def run_replica(role: Literal["policy", "rollout"], *, controller: str, name: str) -> int:
    """Join the job at `controller` (HOST:PORT) as `name` and run `role` until the job ends."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != 1:
        raise ValueError(
            f"replica {name}: {world_size} processes per replica are not wired into the runtime "
            "yet; run each replica as one process (parallelism inside a replica is in progress)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    session = ReplicaSession.join(controller, name=name, role=role, world_size=world_size)
    # At once, not after loading the model: a load slower than the heartbeat timeout must not
    # get the replica reaped before it starts.
    session.start_heartbeats()
    # A scheduler's pre-emption signal (train.save_ckpt_at_exit) asks for a checkpoint; the
    # replica goes on (SIGUSR1 would otherwise end it).
    forward_checkpoint_signals(session.cfg.train, session.client.request_checkpoint)
    try:
        if role == "policy":
            from nebula_rl.policy.worker import run_policy

            run_policy(session, device=device)
        else:
            from nebula_rl.rollout.worker import run_rollout

            run_rollout(session, device=device)
    finally:
        session.leave()
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
