"""The controller's loop: hand out prompts, judge groups, schedule training steps, end the job.

The controller never touches a tensor. One pass of `Scheduler.run` does, in order:

1. `release_prompts`: hand out prompts up to the staleness bound (below);
2. `judge_groups`: read the groups rollout replicas pushed; accept them into the buffer, or drop
   them (stale: the prompt is requeued; all rewards equal under dynamic sampling: filtered);
3. `collect_results`: record a finished training step (ledger, version, `metrics.jsonl`);
4. `schedule_step`: when a full batch is buffered and no step runs, send each policy replica a
   `train` command for its share.

Several policy replicas train as one data-parallel policy: the global batch of a step is
`train_batch_per_replica` groups per replica; replica `r` (its rank in registration order)
trains slice `r`, the replicas sum their gradients (:mod:`nebula_rl.policy.replicas`) and take the
same optimiser step, and rank 0 pushes the new weights to the rollouts. A step is recorded when
every replica reported it.

Staleness. With `A = allowed_outdated_steps`, the batch of step `s` is trained with policy version
`s - 1` and must come from weights of version `>= s - 1 - A`. So when version `V` is reached, the
prompts of step `V + 1 + A` are released, tagged `min_version = V` (a rollout replica holds a
prompt until it has those weights). `A = 0` is synchronous on-policy RL: the prompts of a step go
out only after the previous step's weights. Groups that still end up too old (a slow replica)
are dropped when judged or when batched, and their prompts requeued: trained samples are never
staler than `A`. Weights reach the rollouts every `sync_weight_interval` steps, so prompts are
tagged with the last synced version.

Checkpoints. With `train.ckpt.enable_checkpoint`, the `train` command of every `save_freq`-th
step (and of the last) asks policy rank 0 to checkpoint after the step, and when the controller
records that step it saves a snapshot of the job's Redis state next to it
(`checkpoints/controller/step_<N>.json`). `train.resume` restores both: the policy loads its
checkpoint, the controller its snapshot, so the ledger, the buffer and the policy version are
those of step N; prompts trained after step N by the interrupted run are trained again, once.

Simplifications: a fixed set of policy replicas (`--policy N`); one step in flight; a restarted
controller continues from Redis, but the steps it recorded in `metrics.jsonl` before the restart
are not rewritten.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from nebula_rl.config import Config
from nebula_rl.controller.app import RegisterRequest
from nebula_rl.controller.state import JobState
from nebula_rl.data import epoch_order, rl_prompt
from nebula_rl.protocol import Prompt, RolloutGroup

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)


class Scheduler:
    """Runs one RL job to its end over `state`; see the module docstring for the loop."""

    def __init__(
        self,
        cfg: Config,
        state: JobState,
        *,
        rows: list[dict[str, Any]],
        total_steps: int,
        num_rollout: int,
        run_dir: Path,
        num_policy: int = 1,
    ) -> None:
        p = cfg.grpo
        self.cfg, self.state, self.rows = cfg, state, rows
        self.total_steps, self.num_rollout, self.run_dir = total_steps, num_rollout, run_dir
        self.num_policy = num_policy
        self.batch_per_replica = cfg.train.train_batch_per_replica
        self.batch_size = self.batch_per_replica * num_policy
        self.sync_interval = cfg.train.sync_weight_interval
        self.allowed = 0 if p.on_policy else p.allowed_outdated_steps
        if self.sync_interval > 1 and self.allowed < self.sync_interval - 1:
            raise ValueError(
                f"train.train_policy.allowed_outdated_steps ({self.allowed}) must be at least "
                f"train.sync_weight_interval - 1 ({self.sync_interval - 1}): rollouts hold "
                "weights that many steps old between syncs"
            )
        self.num_prompts = cfg.train.epoch * len(rows)
        self._orders: dict[int, list[int]] = {}
        self._step_in_flight: dict[str, Any] | None = None
        self._last_step_end = time.monotonic()
        self._tokens_received = 0
        self._start = time.monotonic()
        self._last_reap = 0.0
        self.metrics_path = run_dir / "metrics.jsonl"
        self.snapshots = run_dir / "checkpoints" / "controller"

    # -- registration ---------------------------------------------------------------------------

    def on_register(self, req: RegisterRequest) -> dict[str, Any]:
        """Extra answer fields for a joining replica: its ranks. A policy replica gets its
        `policy_rank` (0..N-1); rank 0 is also rank 0 of the weight group, the sender. A rollout
        replica gets its `weight_rank` (1..M)."""
        if req.role == "policy":
            rank = self.state.assign_rank(
                "policy_ranks", req.name, first=0, capacity=self.num_policy
            )
            return {"policy_rank": rank, "weight_rank": 0 if rank == 0 else None}
        rank = self.state.assign_rank("weight_ranks", req.name, first=1, capacity=self.num_rollout)
        return {"weight_rank": rank}

    # -- the loop -------------------------------------------------------------------------------

    def run(self, *, poll_ms: int = 20) -> None:
        """Schedule until `total_steps` are trained (or the prompts run out), then stop the
        policy replica, which exports the final weights, and mark the job finished."""
        while self.state.step() < self.total_steps:
            self.reap()
            self.release_prompts()
            self.judge_groups(block_ms=poll_ms)
            self.collect_results()
            self.schedule_step()
            if self._exhausted():
                log.warning("the dataset ran out of prompts after step %d", self.state.step())
                break
        self.stop_policy()
        self.write_ledger()
        self.state.finish("done")
        log.info("job finished at step %d", self.state.step())

    def reap(self, every_s: float = 1.0) -> None:
        """Remove replicas that stopped heartbeating; their prompts go back to the queue."""
        now = time.monotonic()
        if now - self._last_reap >= every_s:
            self._last_reap = now
            self.state.reap_dead_replicas(self.cfg.controller.heartbeat_timeout)

    def release_prompts(self) -> int:
        """Hand out prompts up to the staleness bound; returns how many were released."""
        version = self.state.policy_version()
        wanted = (version + 1 + self.allowed) * self.batch_size + self.state.filtered_total()
        target = min(self.num_prompts, wanted)
        released = self.state.released()
        if released >= target:
            return 0
        synced = version - version % self.sync_interval
        prompts = [self._prompt(k, min_version=synced) for k in range(released, target)]
        return self.state.enqueue_prompts(prompts)

    def _prompt(self, ordinal: int, *, min_version: int) -> Prompt:
        p, n = self.cfg.grpo, len(self.rows)
        epoch, position = divmod(ordinal, n)
        if epoch not in self._orders:
            seed = self.cfg.train.seed or 0
            self._orders[epoch] = epoch_order(
                n, epoch=epoch, shuffle=p.dataloader_shuffle, seed=seed
            )
        index = self._orders[epoch][position]
        return rl_prompt(self.cfg, self.rows, epoch=epoch, index=index, min_version=min_version)

    def judge_groups(self, *, block_ms: int) -> None:
        """Accept, filter or drop every group the rollouts pushed."""
        version = self.state.policy_version()
        for msg_id, group in self.state.poll_groups(256, block_ms):
            self._tokens_received += sum(len(c.token_ids) for c in group.completions)
            if group.extra.get("filtered"):
                self.state.mark_filtered(group, msg_id=msg_id)
            else:
                self.state.accept_group(group, version, self.allowed, msg_id=msg_id)

    def schedule_step(self) -> None:
        """Send the `train` commands of the next step when a full batch is buffered, every
        policy replica has joined, and no step is running."""
        if self._step_in_flight is not None or self.state.step() >= self.total_steps:
            return
        holders = self.state.rank_holders("policy_ranks")
        if len(holders) < self.num_policy:
            return
        version = self.state.policy_version()
        batch = self.state.next_batch(
            self.batch_size, current_version=version, allowed_outdated_steps=self.allowed
        )
        if batch is None:
            return
        staleness = [version - g.policy_version for g in batch]
        step = self.state.step() + 1
        self._step_in_flight = {
            "step": step,
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "sent": time.monotonic(),
            "groups": batch,
            "results": {},
        }
        push = step % self.sync_interval == 0 and step < self.total_steps
        ckpt = self.cfg.train.ckpt
        checkpoint = ckpt.enable_checkpoint and (
            step % ckpt.save_freq == 0 or step == self.total_steps
        )
        self._step_in_flight["checkpoint"] = checkpoint
        size = self.batch_per_replica
        for rank, name in sorted(holders.items()):
            shard = batch[rank * size : (rank + 1) * size]
            command = {
                "type": "train",
                "step": step,
                "prompt_ids": [g.prompt.prompt_id for g in shard],
                "push_weights": push and rank == 0,
                "checkpoint": checkpoint and rank == 0,
            }
            self.state.send_command(command, to=name)

    def collect_results(self) -> None:
        """Record finished steps: ledger, policy version, one `metrics.jsonl` line each."""
        for msg_id, result in self.state.poll_results():
            inflight = self._step_in_flight
            # (a result recorded before a restart or restore comes back once: it is not new)
            fresh = result.get("step", 0) > self.state.step()
            if result.get("type") == "train" and inflight is not None and fresh:
                assert result["step"] == inflight["step"], (result, inflight["step"])
                inflight["results"][result["rank"]] = result
                if len(inflight["results"]) == self.num_policy:
                    self._record_step()
            self.state.ack_result(msg_id)

    def _record_step(self) -> None:
        inflight = self._step_in_flight
        assert inflight is not None
        groups: list[RolloutGroup] = inflight["groups"]
        step = inflight["step"]
        self.state.mark_trained([g.prompt.prompt_id for g in groups], step)
        version = self.state.bump_policy_version()
        if inflight["checkpoint"]:
            self._save_snapshot(step)
        now = time.monotonic()
        ledger = self.state.ledger_summary(groups[0].prompt.epoch)
        results = inflight["results"]
        record = {
            "step": step,
            "policy_version": version,
            # The replicas reduce their metrics over the whole batch; rank 0's stand for all.
            **results[0]["metrics"],
            "staleness_mean": inflight["staleness_mean"],
            "staleness_max": inflight["staleness_max"],
            "stale_dropped": ledger["stale_dropped"],
            "groups_filtered": ledger["filtered"],
            "step_time": now - self._last_step_end,
            "train_time": max(r["train_time"] for r in results.values()),
            "wait_for_batch_time": inflight["sent"] - self._last_step_end,
            # Over the whole run: a window per step can be empty when rollouts run ahead.
            "rollout_tokens_per_s": self._tokens_received / max(now - self._start, 1e-9),
        }
        self._last_step_end = now
        self._step_in_flight = None
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info(
            "step %d/%d reward %.3f loss %.4f staleness %.1f/%d %.2fs",
            record["step"],
            self.total_steps,
            record.get("reward_mean", float("nan")),
            record.get("loss", float("nan")),
            record["staleness_mean"],
            record["staleness_max"],
            record["step_time"],
        )

    def _save_snapshot(self, step: int) -> None:
        """The job's Redis state after `step`, next to the policy's checkpoint of that step;
        snapshots older than every complete policy checkpoint are deleted."""
        from nebula_rl.policy.checkpoint import complete_checkpoints

        self.snapshots.mkdir(parents=True, exist_ok=True)
        path = self.snapshots / f"step_{step}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "keys": self.state.snapshot()}))
        tmp.replace(path)
        kept = [s for s, _ in complete_checkpoints(self.run_dir)]
        for old in self.snapshots.glob("step_*.json"):
            old_step = int(old.stem.removeprefix("step_"))
            if kept and old_step < min(kept):
                old.unlink()

    def restore(self) -> Path | None:
        """Put the job back at the checkpoint `train.resume` names; returns the policy's
        checkpoint folder (None: nothing to resume, the job starts at step 1)."""
        from nebula_rl.local import drop_steps_after
        from nebula_rl.policy.checkpoint import complete_checkpoints, is_checkpoint

        resume = self.cfg.train.resume
        if resume is False:
            return None
        if resume is True:
            found = [
                (step, path)
                for step, path in complete_checkpoints(self.run_dir)
                if (self.snapshots / f"step_{step}.json").exists()
            ]
            if not found:
                log.info(
                    "train.resume: no checkpoint under %s yet: starting at step 1", self.run_dir
                )
                return None
            step, path = found[-1]
            snapshot = self.snapshots / f"step_{step}.json"
        else:
            path = Path(resume)
            snapshot = path.parent / "controller" / f"{path.name}.json"
            if not is_checkpoint(path) or not snapshot.exists():
                raise ValueError(
                    f"train.resume: {path} is not a complete checkpoint of a multi-process job "
                    f"(needs its manifest.json and {snapshot})"
                )
        data = json.loads(snapshot.read_text())
        self.state.restore(data["keys"])
        drop_steps_after(self.metrics_path, data["step"])  # later steps are trained again
        log.info("resumed the job at step %d from %s", data["step"], path)
        return path

    def _exhausted(self) -> bool:
        """No step can be formed any more: every prompt is handed out and resolved, the buffer
        holds less than a batch, and no step runs."""
        if self._step_in_flight is not None or self.state.released() < self.num_prompts:
            return False
        open_prompts = sum(
            s["outstanding"] + s["requeued"]
            for s in (self.state.ledger_summary(e) for e in self.state.epochs())
        )
        return open_prompts == 0 and self.state.buffer_size() < self.batch_size

    def write_ledger(self) -> None:
        """`ledger.json`: per epoch, the ledger counts and how often each row was trained."""
        ledger = {
            str(epoch): {
                "summary": self.state.ledger_summary(epoch),
                "trained": self.state.trained_counts(epoch),
            }
            for epoch in self.state.epochs()
        }
        (self.run_dir / "ledger.json").write_text(json.dumps(ledger, indent=1))

    def stop_policy(self, *, timeout_s: float = 600.0) -> None:
        """Let the policy replicas finish their last step, export, and confirm; raises on
        timeout."""
        deadline = time.monotonic() + timeout_s
        while self._step_in_flight is not None:
            self.collect_results()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the policy did not finish step {self._step_in_flight['step']}")
            time.sleep(0.02)
        holders = self.state.rank_holders("policy_ranks")
        for name in holders.values():
            self.state.send_command({"type": "stop"}, to=name)
        stopped: set[int] = set()
        while time.monotonic() < deadline:
            for msg_id, result in self.state.poll_results(block_ms=200):
                self.state.ack_result(msg_id)
                if result.get("type") == "stopped":
                    stopped.add(result["rank"])
            if len(stopped) == len(holders):
                return
        raise TimeoutError(
            f"policy rank(s) {sorted(set(holders) - stopped)} did not confirm the stop within "
            f"{timeout_s:.0f} s"
        )


def run_controller(
    cfg: Config,
    *,
    run_dir: Path,
    redis_url: str,
    token: str,
    host: str,
    port: int,
    num_rollout: int,
    num_policy: int = 1,
) -> None:
    """The controller process: serve the API at `host:port` and schedule the job to its end.

    It also serves the TCPStore where the replicas' process groups meet (the weight group of
    policy rank 0 and the rollouts, and the policy replicas' data-parallel group), so that no
    replica has to run on the controller's host."""
    import re

    from nebula_rl.controller.app import create_app, serve
    from nebula_rl.controller.redis_server import connect
    from nebula_rl.data import num_train_steps, rl_rows
    from nebula_rl.weights import free_port, serve_store

    rows = rl_rows(cfg)
    total_steps = num_train_steps(cfg, len(rows))
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", run_dir.name)[:64] or "job"
    state = JobState(connect(redis_url), job)
    scheduler = Scheduler(
        cfg,
        state,
        rows=rows,
        total_steps=total_steps,
        num_rollout=num_rollout,
        num_policy=num_policy,
        run_dir=run_dir,
    )
    resume_from = scheduler.restore()
    store_port = free_port(host)
    store = serve_store(host, store_port)  # noqa: F841 (kept alive for the job)
    rendezvous = {"host": host, "port": store_port, "hosted": True}
    meta = {
        "redis_url": redis_url,
        "run_dir": str(run_dir),
        "total_steps": total_steps,
        "resume_from": None if resume_from is None else str(resume_from),
        "weights": {**rendezvous, "name": f"{job}-weights-0", "world_size": 1 + num_rollout},
        "policy_group": {**rendezvous, "name": f"{job}-policy-0", "world_size": num_policy},
    }
    app = create_app(
        state=state,
        config_json=cfg.model_dump(mode="json"),
        token=token,
        meta_extra=meta,
        on_register=scheduler.on_register,
    )
    with serve(app, host=host, port=port) as server:
        log.info("controller of job %s at %s: %d steps", job, server.url, total_steps)
        scheduler.run()
        _wait_for_replicas(state, timeout_s=30.0)


def _wait_for_replicas(state: JobState, *, timeout_s: float) -> None:
    """Give replicas time to see the end and unregister before the API goes away."""
    deadline = time.monotonic() + timeout_s
    while state.replicas() and time.monotonic() < deadline:
        time.sleep(0.1)
