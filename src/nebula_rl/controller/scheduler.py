"""The controller's loop: hand out prompts, judge groups, schedule training steps, end the job.

The controller never touches a tensor. One pass of `Scheduler.run` does, in order:

1. `reap` and `sync_groups`: remove replicas that stopped heartbeating (their prompts go back to
   the queue) and publish a new generation of a group whose membership changed (below);
2. `release_prompts`: hand out prompts up to the staleness bound (below);
3. `judge_groups`: read the groups rollout replicas pushed; accept them into the buffer, or drop
   them (stale: the prompt is requeued; all rewards equal under dynamic sampling: filtered);
4. `collect_results`: record a finished training step (ledger, version, `metrics.jsonl`), or
   react to a regroup or a failure the policy replicas report;
5. `schedule_step`: when a full batch is buffered and no step runs, send each policy replica a
   `train` command for its share.

Several policy replicas train as one data-parallel policy: a step's `train_batch_per_replica`
groups per initial replica are split between the current members, which sum their gradients
(:mod:`nebula_rl.policy.replicas`); a step is recorded when every member reported it.

Elasticity. Replicas join (`nebula-rl replica ...`) and leave (they exit, or miss heartbeats for
`controller.heartbeat_timeout` s) while the job runs; two groups follow, each as generations:

- the policy group (policy replicas, data parallel): on a change each member gets a `regroup`
  command; the members build the new group and agree on one training state (a joining replica
  receives the weights and optimiser state of a live one). Once all confirmed, the step in flight
  is recorded if the survivors completed it, else sent again, split among the new members;
- the weight group (policy rank 0, then the ready rollout replicas): the sender rebuilds it and
  pushes the current weights, so a joining rollout starts from them.

A member whose collective fails reports it; the group is rebuilt among the live members once the
heartbeats have had time to tell who died. Lost work is re-issued: a dead rollout's prompts go back
to the queue, a dead policy replica's share of the step goes to the survivors, and redelivered
groups and results are deduplicated by prompt id and step.

Restarts. Everything the loop needs is in Redis: the ledger, the buffer, the group generations,
the step in flight (`step_plan`) and each recorded step's metrics (appended with the ledger update
in one transaction, then written to `metrics.jsonl`). A controller restarted on the same Redis
(the launcher restarts one that was killed) continues the job: it sends the step in flight again
(replicas answer a step they already trained with the same result) and writes the steps the file
lacks; replicas keep working while it is down and reach it again on their next heartbeat.

Staleness. With `A = allowed_outdated_steps`, the batch of step `s` is trained with policy version
`s - 1` and must come from weights of version `>= s - 1 - A`. So when version `V` is reached, the
prompts of step `V + 1 + A` are released, tagged `min_version = V` (a rollout replica holds a
prompt until it has those weights). `A = 0` is synchronous on-policy RL: the prompts of a step go
out only after the previous step's weights. Groups that still end up too old (a slow replica)
are dropped when judged or batched, their prompts requeued. Weights reach the rollouts every
`sync_weight_interval` steps, so prompts are tagged with the last synced version.

In-flight ceiling. With `train_policy.max_inflight_steps = M`, the prompts handed out and not yet
resolved (trained, or dropped by dynamic sampling) never exceed `M` global batches: a hard
bound on top of the staleness release (which itself keeps them within `A + 1` batches, and the
config raises `M` to at least that). Dynamic sampling: when the groups dropped while a step's
batch fills need more than `max_retry_for_on_policy` batches' worth of replacement prompts, the
job fails with an error naming that key.

Validation. With `validation.enable`, the weights of step `s` are validated at the steps
`nebula_rl.utils.validation.validation_due` names (0 with `val_before_train`, every `freq`, the last).
The train command of such a step always pushes its weights; when the step is recorded, one
validation prompt per validation row goes out on the `val_prompts` stream with `min_version = s`
(`JobState.enqueue_validation`; with step 0 at the start). Rollout replicas generate them first,
with the validation sampling and rewards, and their groups come back with the training groups;
each row is answered exactly once (a dead replica's validation prompts are requeued), and
validation prompts count neither in the training ledger nor in the staleness bound. Step `s + 1`
is sent only once the validation of `s` is recorded, so the rollouts validate exactly the
weights of `s` (no newer ones exist yet): the policy waits for the validation, generation goes
on. The `val/*` numbers go into a record of their own with `"step": s`, appended after the
step's record (readers merge the records of a step), since the step is recorded before its
validation runs; the job ends once the last step's validation is recorded.

Checkpoints. With `train.ckpt.enable_checkpoint`, the `train` command of every `save_freq`-th
step (with `save_freq_in_epoch`, of each epoch's last step of every that many epochs; and of the
last step) asks policy rank 0 to checkpoint after the step, and when the controller
records that step it saves a snapshot of the job's Redis state next to it (`snapshots.py`,
`checkpoints/controller/step_<N>.json`). `train.resume` restores both: the policy loads its
checkpoint, the controller its snapshot, so the ledger, the buffer and the policy version are
those of step N; prompts trained after step N by the interrupted run are trained again, once.

The groups' members meet in the job's Redis (`weights/store.py`), which has the job's password:
the controller serves no rendezvous port of its own, and a restarted controller changes nothing
for groups built before.

Simplifications: one step in flight; the global batch stays that of the initial `num_policy`
replicas whatever their number later; the dynamic-sampling count of `max_retry_for_on_policy`
starts again from zero when the controller restarts; a run whose prompts run out before
`total_steps` (dynamic sampling) is not validated after its last step, since that step's weights
were not pushed.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nebula_rl.config import Config
from nebula_rl.controller.snapshots import SideFiles, Snapshots
from nebula_rl.controller.state import JobState
from nebula_rl.data import epoch_order, rl_prompt, rl_validation_rows
from nebula_rl.protocol import Prompt
from nebula_rl.utils.metrics_log import FILE_LOGGERS, log_image_file, open_loggers
from nebula_rl.utils.validation import validation_due, validation_metrics

if TYPE_CHECKING:
    from nebula_rl.utils.object_store import Uploader

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)

GROUPS_PER_POLL = 1024
"""Most groups judged in one transaction (32 MiB of groups of 8 x 128 tokens)."""


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
        val_rows: list[dict[str, Any]] | None = None,
        side_files: SideFiles | None = None,
        with_text: bool = True,
        sample_lengths: bool = True,
        uploader: Uploader | None = None,
    ) -> None:
        p = cfg.grpo
        self.cfg, self.state, self.rows = cfg, state, rows
        self.side_files = side_files
        """Files the groups refer to (a world model's trajectories): deleted once their step is
        recorded, kept with each snapshot and put back by `Snapshots.restore`."""
        self.total_steps, self.num_rollout, self.run_dir = total_steps, num_rollout, run_dir
        self.num_policy = num_policy
        self.batch_per_replica = cfg.groups_per_replica
        self.batch_size = self.batch_per_replica * num_policy
        self.sync_interval = cfg.train.sync_weight_interval
        # (the config raised it to at least sync_weight_interval - 1, as cosmos-rl does)
        self.allowed = p.allowed_outdated_steps
        self.num_prompts = cfg.train.epoch * len(rows)
        self.steps_per_epoch = len(rows) // self.batch_size
        """Steps of an epoch (`num_train_steps`'s count; epoch-based checkpoints)."""
        self.max_inflight = p.max_inflight_steps
        self.max_retry = p.max_retry_for_on_policy if p.dynamic_sampling_enabled else 0
        self._filtered_at_batch = state.filtered_total()
        """Groups dropped by dynamic sampling before the last batch was taken."""
        # (with a local dataset, or a world model's clips, every replica reads its own copy)
        self.with_text = with_text and not cfg.train.local_dataset
        self.sample_lengths = sample_lengths
        if val_rows is None and cfg.validation.enable:
            val_rows = rl_validation_rows(cfg)
        self.val_rows = val_rows or []
        self._orders: dict[int, list[int]] = {}
        self.heartbeat_timeout = cfg.controller.heartbeat_timeout
        self._due: dict[str, float] = {}
        self._last_sync = 0.0
        self._first_ready: float | None = None
        self._plan = state.step_plan()  # a restarted controller finds its step in flight
        self._sent: float | None = None
        self._lines_written: int | None = None
        self._last_step_end = time.monotonic()
        self._tokens_received = 0
        self._start = time.monotonic()
        self._last_reap = 0.0
        self.metrics_path = run_dir / "metrics.jsonl"
        self.snapshots = Snapshots(
            cfg.train, state, run_dir, side_files=side_files, uploader=uploader
        )
        """The job's state at each policy checkpoint (`train.resume` puts it back)."""
        # The file sinks of `[logging] logger`; the launcher, which owns the terminal, the console.
        self.loggers = open_loggers(cfg, run_dir, total_steps=total_steps, only=FILE_LOGGERS)

    # -- membership -----------------------------------------------------------------------------

    def _ready(self, role: str) -> dict[str, int]:
        """Registered replicas of `role` that loaded their model -> their replica ids, oldest
        registration first."""
        ready = sorted((i, name) for name, i in self.state.ready_replicas(role).items())
        return {name: replica_id for replica_id, name in ready}

    @staticmethod
    def _wanted(record: dict[str, Any], ready: dict[str, int]) -> list[str]:
        """The members a group should have: the current ones that are still the same processes
        (a replica restarted under its name has a new id: it joins again), then newcomers."""
        members = [m for m in record["members"] if ready.get(m) == record["ids"].get(m)]
        return members + [n for n in ready if n not in members]

    @staticmethod
    def _changed(record: dict[str, Any], members: list[str], ids: dict[str, int]) -> bool:
        """Whether `members` (with replica ids `ids`) differ from the group's generation."""
        return members != record["members"] or any(record["ids"].get(m) != ids[m] for m in members)

    def _regroup_due(self, kind: str, generation: int) -> bool:
        """Whether a member asked to rebuild generation `generation` of `kind` long enough ago
        that the heartbeats have told who is dead (so the new generation leaves them out)."""
        if self.state.regroup_requested(kind) < generation:
            self._due.pop(kind, None)
            return False
        due = self._due.setdefault(kind, time.monotonic() + self.heartbeat_timeout + 1.0)
        return time.monotonic() >= due

    def _publish(self, kind: str, members: list[str], ids: dict[str, int]) -> dict[str, Any]:
        replicas = self.state.replicas()
        sizes = {
            name: int(replicas[name]["world_size"]) if name in replicas else 1 for name in members
        }
        record = self.state.publish_group(kind, members, ids=ids, sizes=sizes)
        self._due.pop(kind, None)
        log.info("%s group generation %d: %s", kind, record["generation"], ", ".join(members))
        return record

    def sync_groups(self, every_s: float = 0.25) -> None:
        """Publish a new generation of a group whose membership changed: replicas that joined
        (and are ready), left or were reaped, or a member that found the group broken. The
        policy replicas' group first waits for the `num_policy` initial replicas (or, after a
        heartbeat timeout, for those still registered: one may have died starting), then takes
        every ready one (up to the global batch size, one group per replica); the weight group
        is policy rank 0 (the sender) and every ready rollout replica."""
        now = time.monotonic()
        if now - self._last_sync < every_s:
            return
        self._last_sync = now
        self._sync_policy_group()
        self._sync_weight_group()

    def _initial_policy_members(self, ready: dict[str, int]) -> list[str] | None:
        """Who forms the first policy group, None while it should wait for more."""
        if not ready:
            return None
        if len(ready) >= self.num_policy:
            return list(ready)
        if self._first_ready is None:
            self._first_ready = time.monotonic()
        registered = [i for i in self.state.replicas().values() if i["role"] == "policy"]
        waited = time.monotonic() - self._first_ready > self.heartbeat_timeout
        return list(ready) if waited and len(registered) == len(ready) else None

    def _sync_policy_group(self) -> None:
        record = self.state.group_record("policy")
        ready = self._ready("policy")
        if record is None:
            initial = self._initial_policy_members(ready)
            if initial is not None:
                if len(initial) < self.num_policy:
                    log.warning(
                        "%d of %d policy replicas are up: starting without the others",
                        len(initial),
                        self.num_policy,
                    )
                self._publish_policy(initial[: self.batch_size], ready)
            return
        wanted = self._wanted(record, ready)[: self.batch_size]
        if not wanted:
            return  # no policy replica left: wait for one to join
        if self._changed(record, wanted, ready) or self._regroup_due(
            "policy", record["generation"]
        ):
            self._publish_policy(wanted, ready)

    def _publish_policy(self, members: list[str], ids: dict[str, int]) -> None:
        record = self._publish("policy", members, ids)
        for name in members:
            self.state.send_command({"type": "regroup", "group": record}, to=name)

    def _sync_weight_group(self) -> None:
        policy = self.state.group_record("policy")
        if policy is None:
            return
        sender = policy["members"][0]
        ready = {sender: policy["ids"][sender], **self._ready("rollout")}
        record = self.state.group_record("weights")
        if record is None:
            members = list(ready)
        else:
            # (the sender stays first: `_wanted` keeps the order of those already in)
            members = [sender, *(m for m in self._wanted(record, ready) if m != sender)]
        if (
            record is None
            or self._changed(record, members, ready)
            or self._regroup_due("weights", record["generation"])
        ):
            self._publish("weights", members, ready)

    def _formed_policy_group(self) -> dict[str, Any] | None:
        """The policy group's record once every member joined it and agreed on the state."""
        record = self.state.group_record("policy")
        if record is None or set(record["confirmed"]) != set(record["members"]):
            return None
        return record

    def resume_in_flight(self) -> None:
        """After a restart: send again what the previous controller may not have finished
        sending (replicas answer a command they already carried out with the same result)."""
        record = self.state.group_record("policy")
        if record is None:
            return
        missing = [m for m in record["members"] if m not in record["confirmed"]]
        for name in missing:
            self.state.send_command({"type": "regroup", "group": record}, to=name)
        plan = self._plan
        if plan is None or missing:
            return  # (the last confirmation will handle the plan)
        if plan["generation"] == record["generation"]:
            log.info("sending step %d again after the restart", plan["step"])
            self._send_step(plan, record)
        else:  # the group was re-formed but the plan not yet handled when the controller died
            self._policy_group_formed(record)

    # -- the loop -------------------------------------------------------------------------------

    def run(self, *, poll_ms: int = 20) -> None:
        """Schedule until `total_steps` are trained (or the prompts run out), then stop the
        policy replica, which exports the final weights, and mark the job finished."""
        self.start_due_validation()
        self.record_validations()  # (answered before a restart, not yet recorded)
        while self.state.step() < self.total_steps:
            self.reap()
            self.sync_groups()
            self.release_prompts()
            self.judge_groups(block_ms=poll_ms)
            self.collect_results()
            self.schedule_step()
            if self._exhausted():
                log.warning("the dataset ran out of prompts after step %d", self.state.step())
                break
        while self.state.pending_validations():  # the last step's
            self.reap()
            self.sync_groups()
            self.judge_groups(block_ms=poll_ms)
            self.collect_results()
        self.stop_policy()
        self.write_ledger()
        self.state.finish("done")
        self.loggers.close()
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
        filtered = self.state.filtered_total()
        wanted = (version + 1 + self.allowed) * self.batch_size + filtered
        target = min(self.num_prompts, wanted)
        if self.max_inflight is not None:  # handed out and not resolved: at most M batches
            resolved = self.state.step() * self.batch_size + filtered
            target = min(target, resolved + self.max_inflight * self.batch_size)
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
            self._orders[epoch] = epoch_order(
                n, epoch=epoch, shuffle=p.dataloader_shuffle, seed=p.dataloader_seed
            )
        index = self._orders[epoch][position]
        return rl_prompt(
            self.cfg.grpo,
            self.rows,
            epoch=epoch,
            index=index,
            min_version=min_version,
            with_text=self.with_text,
        )

    def judge_groups(self, *, block_ms: int) -> None:
        """Accept, filter or drop every group the rollouts pushed (by their headers: the
        completions stay undecoded JSON), in one transaction per poll; keep validation answers
        and record the validations they complete."""
        pushed = self.state.read_groups(GROUPS_PER_POLL, block_ms)
        answers = [g for g in pushed if g.header.prompt.validation_step is not None]
        training = [g for g in pushed if g.header.prompt.validation_step is None]
        self._tokens_received += sum(g.header.num_tokens for g in training)
        self.state.judge_groups(
            training,
            current_version=self.state.policy_version(),
            allowed_outdated_steps=self.allowed,
        )
        if self.state.record_answers(answers):
            self.record_validations()

    # -- validation -----------------------------------------------------------------------------

    def start_due_validation(self) -> None:
        """Hand out the validation of the current step if it is due and was not handed out (at
        the start: step 0 with `val_before_train`, or a step recorded by a controller that died
        before it could)."""
        step = self.state.step()
        if validation_due(self.cfg.validation, step, total_steps=self.total_steps):
            self._start_validation(step)

    def _start_validation(self, step: int) -> None:
        prompts = [
            rl_prompt(
                self.cfg.grpo,
                self.val_rows,
                epoch=0,
                index=i,
                min_version=step,
                with_text=self.with_text,
                validation_step=step,
            )
            for i in range(len(self.val_rows))
        ]
        if self.state.enqueue_validation(step, prompts):
            log.info("validating the weights of step %d on %d prompts", step, len(prompts))

    def record_validations(self) -> None:
        """Record every pending validation whose prompts are all answered: its `val/*` record
        goes into the step records and the sinks."""
        for step in self.state.pending_validations():
            results = self.state.validation_results(step)
            if results is None:
                continue
            rewards = [r for result in results for r in result["rewards"]]
            lengths = [n for result in results for n in result["lengths"]]
            versions = [v for result in results for v in result["versions"]]
            distances = [d for result in results for d in result.get("distances", [])]
            metrics = validation_metrics(
                rewards, lengths if self.sample_lengths else None, versions, distances=distances
            )
            record = {"step": step, **metrics}
            if self.state.finish_validation(step, record):
                self._flush_metrics()
                self.loggers.log(record)
                log.info(
                    "validation of step %d: reward %.3f over %d completions",
                    step,
                    record.get("val/reward_mean", float("nan")),
                    record["val/rollout_count"],
                )

    def schedule_step(self) -> None:
        """Send the `train` commands of the next step when a full batch is buffered, the policy
        replicas' group is formed, and no step is running."""
        if self._plan is not None or self.state.step() >= self.total_steps:
            return
        if self.state.pending_validations():  # the rollouts validate the current weights
            return
        group = self._formed_policy_group()
        if group is None:
            return
        version = self.state.policy_version()
        batch = self.state.next_batch(
            self.batch_size, current_version=version, allowed_outdated_steps=self.allowed
        )
        if batch is None:
            self._check_retries()
            return
        self._filtered_at_batch = self.state.filtered_total()
        staleness = [version - g.policy_version for g in batch]
        step = self.state.step() + 1
        ckpt = self.cfg.train.ckpt
        plan = {
            "step": step,
            "prompt_ids": [g.prompt.prompt_id for g in batch],
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "push": (step % self.sync_interval == 0 and step < self.total_steps)
            or validation_due(self.cfg.validation, step, total_steps=self.total_steps),
            "checkpoint": ckpt.due(
                step, last=step == self.total_steps, steps_per_epoch=self.steps_per_epoch
            )
            # (save_ckpt_at_exit: a signal asked for one, whether or not checkpoints are on)
            or self.state.take_checkpoint_request(),
        }
        self._sent = time.monotonic()
        self._send_step(plan, group)

    def _check_retries(self) -> None:
        """Fail the job when the groups dropped while the next batch fills need more than
        `max_retry_for_on_policy` batches' worth of replacement prompts."""
        if self.max_retry <= 0:
            return
        dropped = self.state.filtered_total() - self._filtered_at_batch
        rounds = -(-dropped // self.batch_size)
        if rounds > self.max_retry:
            reason = (
                f"dynamic sampling dropped {dropped} groups while filling the batch of step "
                f"{self.state.step() + 1} ({rounds} rounds of {self.batch_size} replacement "
                "prompts), more than train.train_policy.max_retry_for_on_policy = "
                f"{self.max_retry}: the rewards barely vary; check the reward functions or "
                "raise the limit"
            )
            self.state.finish(f"failed: {reason}")
            raise RuntimeError(reason)

    def _send_step(self, plan: dict[str, Any], group: dict[str, Any]) -> None:
        """Send step `plan` to the members of policy group generation `group`: rank `r` trains
        the `r`-th of as many near-equal slices of the batch as there are members (the step does
        not depend on the split: the loss takes the global counts)."""
        members = group["members"]
        plan = {
            **plan,
            "generation": group["generation"],
            "attempt": secrets.token_hex(6),
            "members": members,
            "results": {},
        }
        self._plan = plan
        self.state.save_step_plan(plan)  # before the commands: a restart finds and resends them
        ids = plan["prompt_ids"]
        bounds = [round(r * len(ids) / len(members)) for r in range(len(members) + 1)]
        for rank, name in enumerate(members):
            command = {
                "type": "train",
                "generation": group["generation"],
                "step": plan["step"],
                "attempt": plan["attempt"],
                "prompt_ids": ids[bounds[rank] : bounds[rank + 1]],
                "push_weights": plan["push"] and rank == 0,
                "checkpoint": plan["checkpoint"] and rank == 0,
            }
            self.state.send_command(command, to=name)

    def collect_results(self) -> None:
        """Handle what the policy replicas report: a finished share of the step (the step is
        recorded once every member reported), a finished regroup (the step in flight is then
        recorded, if it was completed, or sent again), or a failure (the group is rebuilt)."""
        for msg_id, result in self.state.poll_results():
            self._on_result(result)
            self.state.ack_result(msg_id)

    def _on_result(self, result: dict[str, Any]) -> None:
        kind = result.get("type")
        record = self.state.group_record("policy")
        current = record is not None and result.get("generation") == record["generation"]
        if kind == "regrouped" and current:
            assert record is not None
            info = {"version": result["version"], "last_result": result["last_result"]}
            record = self.state.confirm_member("policy", record["generation"], result["name"], info)
            if record is not None and set(record["confirmed"]) == set(record["members"]):
                self._policy_group_formed(record)
        elif kind in ("train_failed", "regroup_failed") and current:
            assert record is not None
            log.warning(
                "policy replica %s: %s in group generation %d: %s",
                result["name"],
                kind.replace("_", " "),
                record["generation"],
                result["error"],
            )
            self.state.request_regroup("policy", record["generation"])
        elif kind == "train_lost":
            # Every member hands the step back together, each naming its own lost groups.
            plan = self._plan
            if plan is None or result.get("attempt") != plan.get("attempt"):
                return  # (an attempt sent again since)
            plan.setdefault("lost", {})[result["name"]] = result["lost"]
            if set(plan["lost"]) < set(plan["members"]):
                return
            lost = sorted({i for ids in plan["lost"].values() for i in ids})
            dropped = self.state.release_inflight(lost)
            log.warning(
                "step %d handed back untrained: %d group(s) lost their trajectories with the "
                "rollout replica that held them; their prompts are sampled again",
                plan["step"],
                dropped,
            )
            self._plan, self._sent = None, None
        elif kind == "train":
            plan = self._plan
            # (a result recorded before a restart comes back once: it is not new)
            fresh = result["step"] > self.state.step()
            if plan is None or not fresh or result["generation"] != plan["generation"]:
                return
            assert result["step"] == plan["step"], (result, plan["step"])
            plan["results"][result["name"]] = result
            self.state.save_step_plan(plan)
            if set(plan["results"]) >= set(plan["members"]):
                self._record_step(list(plan["results"].values()))

    def _policy_group_formed(self, record: dict[str, Any]) -> None:
        """Every member of a new policy group generation joined and agreed on the state of
        `version`: the step in flight was completed (record it) or not (send it again)."""
        confirmed = record["confirmed"].values()
        version = max(c["version"] for c in confirmed)
        log.info("policy group generation %d formed at version %d", record["generation"], version)
        if version < self.state.step():
            self.state.finish(f"failed: the policy state of step {self.state.step()} is lost")
            raise RuntimeError(
                f"every policy replica holding the weights of step {self.state.step()} is gone "
                f"(the live ones hold version {version}); resume the job from a checkpoint"
            )
        plan = self._plan
        if plan is None:
            return
        if version >= plan["step"]:
            results = [c["last_result"] for c in confirmed if c["last_result"] is not None]
            self._record_step(results[:1])
        else:
            log.info("sending step %d again to %d replica(s)", plan["step"], len(record["members"]))
            self._send_step(plan, record)

    def _record_step(self, results: list[dict[str, Any]]) -> None:
        """Record the step in flight, trained with these `results` (empty when the replicas
        completed the step but its metric sums failed: the metrics are lost)."""
        plan = self._plan
        assert plan is not None
        step = plan["step"]
        now = time.monotonic()
        sent = self._sent if self._sent is not None else now
        # The replicas reduce their metrics over the whole batch; any one's stand for all.
        metrics = min(results, key=lambda r: r["rank"])["metrics"] if results else {}
        record = {
            "step": step,
            "policy_version": step,
            **metrics,
            "staleness_mean": plan["staleness_mean"],
            "staleness_max": plan["staleness_max"],
            "step_time": now - self._last_step_end,
            "train_time": max((r["train_time"] for r in results), default=0.0),
            "wait_for_batch_time": max(sent - self._last_step_end, 0.0),
            # Over the whole run: a window per step can be empty when rollouts run ahead.
            "rollout_tokens_per_s": self._tokens_received / max(now - self._start, 1e-9),
            "num_policy_replicas": len(plan["members"]),
        }
        if not results:
            record["metrics_lost"] = True
        epoch = int(plan["prompt_ids"][0].split(":")[0])
        record |= self.state.step_counters(epoch)
        self.state.mark_trained(plan["prompt_ids"], step, policy_version=step, record=record)
        if self.side_files is not None:
            self.side_files.discard(plan["prompt_ids"])
        self._plan, self._sent = None, None
        self._last_step_end = now
        if validation_due(self.cfg.validation, step, total_steps=self.total_steps):
            self._start_validation(step)  # (before the snapshot: a resume validates it again)
        if plan["checkpoint"]:
            self.snapshots.save(step)
        self._flush_metrics()
        self.loggers.log(record)
        every = self.cfg.logging.multi_modal_log_interval
        samples = self.run_dir / "samples" / f"step_{step}.png"
        if every and step % every == 0 and samples.is_file():  # (a world model's sample grid)
            log_image_file(self.loggers, "samples", step, samples)
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

    def _flush_metrics(self) -> None:
        """Append to `metrics.jsonl` the recorded steps it lacks: each step is recorded in Redis
        first (with the ledger), so a controller that died in between writes it after its
        restart, and a line cut short by the crash is rewritten."""
        if self._lines_written is None:
            lines = (
                self.metrics_path.read_text().splitlines(True) if self.metrics_path.exists() else []
            )
            complete = [line for line in lines if line.endswith("\n")]
            if len(complete) != len(lines):
                self.metrics_path.write_text("".join(complete))
            self._lines_written = len(complete)
        records = self.state.step_records(self._lines_written)
        if records:
            with self.metrics_path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            self._lines_written += len(records)

    def _exhausted(self) -> bool:
        """No step can be formed any more: every prompt is handed out and resolved, the buffer
        holds less than a batch, and no step runs."""
        if self._plan is not None or self.state.released() < self.num_prompts:
            return False
        if self.state.buffer_size() >= self.batch_size:
            return False
        open_prompts = sum(
            s["outstanding"] + s["requeued"]
            for s in (self.state.ledger_summary(e) for e in self.state.epochs())
        )
        return open_prompts == 0

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
        """Let the policy replicas finish their last step (rebuilding their group if one fails),
        export, and confirm; raises on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._plan is not None:
            self.reap()
            self.sync_groups()
            self.collect_results()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the policy did not finish step {self._plan['step']}")
            time.sleep(0.02)
        record = self.state.group_record("policy")
        members = [] if record is None else list(record["members"])
        for name in members:
            self.state.send_command({"type": "stop"}, to=name)
        stopped: set[str] = set()
        while time.monotonic() < deadline:
            for msg_id, result in self.state.poll_results(block_ms=200):
                self.state.ack_result(msg_id)
                if result.get("type") == "stopped":
                    stopped.add(result["name"])
            self.reap()
            live = set(self.state.replicas())
            if all(name in stopped or name not in live for name in members):
                return
        raise TimeoutError(
            f"policy replica(s) {sorted(set(members) - stopped)} did not confirm the stop within "
            f"{timeout_s:.0f} s"
        )
