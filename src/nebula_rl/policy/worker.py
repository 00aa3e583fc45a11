"""Policy replica: train on the batches the controller schedules, push weights to the rollouts.

The loop reads commands from the replica's `commands:<name>` stream:

- `regroup`: join the policy replicas' data-parallel group of a new generation (the controller
  sends it when a policy replica joins or leaves, and first of all when the job starts): leave
  the old group, build the new one, and agree on one training state with the other members
  (:meth:`~nebula_rl.policy.replicas.ReplicaGroup.sync_state`: a joining replica receives the
  weights and optimiser state of a live one). The answer (`regrouped`) carries the version this
  state includes, so the controller knows whether the step in flight was completed.
- `train`: take the in-flight batch, run one step of the configured algorithm
  (:meth:`~nebula_rl.policy.trainer.PolicyTrainer.grpo_step`: advantages, loss, `mu_iterations`
  passes in `mini_batch` chunks, one update per `batch_size_per_optimize` slice), then, when
  told to, snapshot the weights into the weight sender's buffers and return at once: the
  broadcast to the rollouts runs in a background thread while the next step trains. The result
  (metrics) goes to the `results` stream, then the command is acknowledged. A train command of
  a superseded generation is skipped; one of a step this replica already trained is answered
  with the cached result (a restarted controller resends).
- `stop`: wait for the last weight push and checkpoint, export the model as a Hugging Face
  folder (with `train.ema_enable`, its weight averages too: `safetensors/final_ema`), confirm.

When a collective with the other replicas fails (one died: gloo notices at once; or one hangs:
the collective times out), the replica reports `train_failed`, leaves the group and waits for the
controller's next `regroup`. Its state is still usable if the step failed before its first or
after its last optimiser update (the common case: the last collectives are the gradient sums and
the metric sums); otherwise it is marked unclean and takes the state of a clean replica.

Between commands, every policy replica follows the weight group's generations
(:class:`~nebula_rl.weights.elastic.ElasticSender`): the one the controller names as sender
(policy rank 0) builds the group with the rollout replicas and pushes the current weights.

A `train` command may ask for a checkpoint after its step (policy rank 0 writes it; the
replicas are identical). With `meta["resume_from"]` every replica loads that checkpoint first.

A replica of several ranks (`[policy.parallelism]`: dp_replicate x dp_shard x cp x tp x pp
processes, see `nebula_rl.launch.replica`) splits the model over its ranks (`parallelize_policy`:
FSDP2/HSDP, TP+SP, PP, CP, activation checkpointing, compile). Its rank 0 alone talks to the
controller: each loop tick it reads whether the job finished, the weight group's generation and
the commands, and hands them to the other ranks (`broadcast_object` on the replica's gloo control
group), together with each step's batch; every rank then carries out the same commands in the
same order, training on its data-parallel share. Across replicas, local rank `i` of every replica
is in one data-parallel group of its own (ranks `i` hold the same shards), and every rank pushes
its own shards to the rollout ranks that need them (`ShardedSender`): nothing is gathered. After
a step or a regroup the ranks agree on its outcome (any rank's collective failure is the
replica's); only rank 0 reports and acknowledges.

Parameters that do not train are pushed to a rollout replica once, on its first push, unless
`rollout.broadcast_all_params`. A LoRA policy (`policy.lora`) pushes its adapter's A/B
matrices (and `modules_to_save`) after each step, the rest under the plain names on a group's
first push (`nebula_rl.models.lora.adapter_parameters`); each rollout rank merges them into its
weights (`nebula_rl.rollout.lora_merge`), so the rollouts never see peft.
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.data import rl_rows
from nebula_rl.data.vision import VisionInputs, VisionProcessor, vision_processor
from nebula_rl.models import load_tokenizer, resolve_dtype
from nebula_rl.models.export import export_hf
from nebula_rl.policy.batching import rollout_media
from nebula_rl.policy.checkpoint import Checkpointer
from nebula_rl.policy.ema import with_ema_export
from nebula_rl.policy.replicas import CollectiveError, GroupsLost, ReplicaGroup
from nebula_rl.policy.setup import (
    load_policy_model,
    parallelize_policy,
    parallelize_reference,
    pushed_weights,
    rollout_weights,
    use_deterministic,
)
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import RolloutGroup
from nebula_rl.utils.profiling import StepProfiler
from nebula_rl.utils.ranks import broadcast_object, control_group, rank_env
from nebula_rl.utils.runs import fetch_missing_checkpoint
from nebula_rl.weights import build_group, weight_backend
from nebula_rl.weights.elastic import KIND, ElasticSender, current_generation
from nebula_rl.weights.group import Generation, GroupCancelled, WeightGroup, leave_group
from nebula_rl.weights.reshard import ShardedSender
from nebula_rl.weights.transport import NamedTensors

__all__ = [
    "PolicyBuilder",
    "PolicyModel",
    "PolicyWorker",
    "Trainer",
    "language_policy",
    "run_policy",
]

log = logging.getLogger(__name__)

POLICY_GROUP = "policy"
"""Kind of the policy replicas' data-parallel group in the job's state."""


class Trainer(Protocol):
    """What the policy loop asks of a modality's trainer (a language model's
    :class:`~nebula_rl.policy.trainer.PolicyTrainer`, a world model's `FlowTrainer`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: Any
    replicas: ReplicaGroup | None
    planned_updates: int | None

    def grpo_step(self, groups: list[RolloutGroup], media: Any = None) -> dict[str, float]: ...


@dataclass(frozen=True, slots=True)
class PolicyModel:
    """What a policy replica trains, as its modality builds it: a language or vision-language
    model (:func:`language_policy`) or a world model (`flow_policy` of the world-model runtime)."""

    hf_model: torch.nn.Module
    trainer: Trainer
    export: Callable[[Path], Any]
    """Writes a loadable folder of the current weights (every rank calls it)."""
    saved: torch.nn.Module
    """What a checkpoint holds (a world model's: with its old weights and averages)."""
    ema: Any = None
    """Weight averages a checkpoint holds beside `saved` (None: none, or inside it)."""
    pushed_weights: Callable[[], NamedTensors] | None = None
    """This rank's tensors as the weight pushes send them (default: the model's parameters)."""
    generated_weights: Callable[[], NamedTensors] | None = None
    """This rank's tensors as a colocated replica's own generator loads them (default: the
    model's parameters; a LoRA language policy's merged, under the plain names)."""
    trainable_only: bool = False
    """Whether checkpoints hold the trainable tensors only (a LoRA policy's adapter)."""
    resumed: Callable[[], None] | None = None
    """Called after a checkpoint was loaded."""
    tokenizer: Any = None
    vision: VisionProcessor | None = None
    """A vision-language model's processor: each prompt's media, built again here."""


PolicyBuilder = Callable[[ReplicaSession, torch.device], PolicyModel]
"""Builds a replica rank's :class:`PolicyModel` from the session's config and the job's meta."""


@dataclass(frozen=True, slots=True)
class _Tick:
    """What rank 0 read from the job's state in one turn of the loop, for every rank."""

    finished: str | None
    weights: Generation | None
    """The weight group's published generation."""
    commands: list[tuple[str, dict[str, Any]]]


class PolicyWorker:
    """One policy replica (this process: one of its ranks): its model and trainer, and the loop
    over its commands."""

    def __init__(
        self, session: ReplicaSession, *, device: torch.device, build: PolicyBuilder | None = None
    ) -> None:
        self.session = session
        cfg, meta = self.cfg, self.meta = session.cfg, session.meta
        ranks = rank_env()
        self.local_rank, self.num_ranks = ranks.rank, ranks.world_size
        self.lead = ranks.rank == 0
        """Whether this is the replica's rank 0 (the one that talks to the controller)."""
        self.backend: Literal["gloo", "nccl"] = "nccl" if device.type == "cuda" else "gloo"
        """Of the policy group (between policy replicas, which never share a GPU)."""
        self.timeout = timedelta(seconds=cfg.controller.collective_timeout)
        use_deterministic(cfg.train)
        self._rows: list[dict[str, Any]] | None = None
        built = (build or language_policy)(session, device)
        self.hf_model, self.trainer, self._export = built.hf_model, built.trainer, built.export
        self.tokenizer, self.vision = built.tokenizer, built.vision
        self.model = self.trainer.model
        """This rank's modules (under PP its stages'); parameters keep their names and are
        DTensor shards where the layout shards them."""
        self.pushed_weights = built.pushed_weights or self.model.named_parameters
        self.generated_weights = built.generated_weights or self.model.named_parameters
        self.siblings = dist.new_group(backend="gloo") if self.num_ranks > 1 else None
        """This replica's ranks, to agree on the outcome of each collective across replicas."""
        self.checkpointer = Checkpointer(
            cfg.train.ckpt,
            Path(meta["run_dir"]),
            model=built.saved,
            optimizer=self.trainer.optimizer,
            scheduler=self.trainer.scheduler,
            ema=built.ema,
            export=self._export,
            trainable_only=built.trainable_only,
            sync_logs=False,  # (the controller copies the run's metrics and logs)
        )
        profile_name = session.name if self.num_ranks == 1 else f"{session.name}-r{ranks.rank}"
        self.profiler = StepProfiler(cfg.profiler, Path(meta["run_dir"]), name=profile_name)
        self.version = 0
        """The last step the training state includes (its policy version)."""
        if meta["resume_from"] is not None:  # every replica loads it: they stay identical
            resume_from = Path(meta["resume_from"])
            if self.local_rank == 0:  # (a node without the run folder: from the storage)
                fetch_missing_checkpoint(cfg.train.ckpt, resume_from)
            if self.siblings is not None:
                dist.barrier(group=self.siblings)
            self.version = self.checkpointer.load(resume_from).step
            if built.resumed is not None:
                built.resumed()
        self.clean = True
        """False after a step failed between two of its optimiser updates."""
        self.optimizer_steps = 0
        self.trainer.optimizer.register_step_post_hook(self._count_step)
        self.generation: Generation | None = None
        """The policy group generation this replica last joined (or tried to)."""
        self.in_sync = False
        """Whether it is a working member of `generation` (joined, state agreed)."""
        self.group: WeightGroup | None = None
        self.last_result: dict[str, Any] | None = None
        self.weights = ElasticSender(
            session.state,
            session.name,
            make_sender=self._make_sender,
            local_rank=self.local_rank,
            all_params=cfg.rollout.broadcast_all_params,
            backend=weight_backend(cfg.mode, device),
            timeout=self.timeout,
        )

    def _count_step(self, *args: Any) -> None:
        self.optimizer_steps += 1

    def _make_sender(self, group: WeightGroup, num_senders: int) -> ShardedSender:
        """This process's shards to every rollout rank that needs them (shared memory on one
        host); frozen tensors only on a group's first push (`rollout.broadcast_all_params`)."""
        transfer = self.cfg.train.transfer_dtype
        return ShardedSender(
            group,
            self.pushed_weights(),
            num_senders=num_senders,
            transfer_dtype=resolve_dtype(transfer) if transfer else None,
        )

    @property
    def rank(self) -> int | None:
        """This replica's rank in the policy group it is a member of."""
        return None if self.generation is None else self.generation.rank_of(self.session.name)

    # -- the replica's ranks ------------------------------------------------------------------------

    def _share(self, value: Any) -> Any:
        """Rank 0's `value` on every rank of the replica."""
        return value if self.num_ranks == 1 else broadcast_object(value)

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank of the replica."""
        if self.num_ranks == 1:
            return [value]
        values: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(values, value, group=control_group())
        return values

    def _tick(self, *, block_ms: int = 500) -> _Tick:
        """Rank 0 reads the job's state (waiting up to `block_ms` for a command); every rank
        gets what it read."""
        tick = None
        if self.lead:
            state = self.session.state
            finished = self.session.finished()
            weights = current_generation(state, KIND)
            commands = [] if finished else state.read_commands(self.session.name, block_ms=block_ms)
            tick = _Tick(finished, weights, list(commands))
        return self._share(tick)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Carry out commands until `stop` or the end of the job."""
        session = self.session
        session.policy_version = lambda: self.version
        session.start_heartbeats()
        session.mark_ready()
        while True:
            tick = self._tick()
            if tick.finished is not None:
                return
            if self.in_sync and self.clean:
                self.weights.refresh(self.pushed_weights, self.version, generation=tick.weights)
            if self.run_commands(tick.commands):
                return

    def run_commands(self, commands: list[tuple[str, dict[str, Any]]]) -> bool:
        """Handle `commands` in order, rank 0 acknowledging each; True once one ended the
        replica's work."""
        for msg_id, command in commands:
            stopped = self.handle(command)
            if self.lead:
                self.session.state.ack_command(self.session.name, msg_id)
            if stopped:
                return True
        return False

    def handle(self, command: dict[str, Any]) -> bool:
        """Carry out one command; True once stopped."""
        kind = command["type"]
        if kind == "regroup":
            self.regroup(Generation.from_record(command["group"]))
        elif kind == "train":
            self.train(command)
        elif kind == "stop":
            self.stop()
            return True
        else:
            raise ValueError(f"unknown command {command!r}")
        return False

    # -- membership -----------------------------------------------------------------------------

    def _leave_group(self) -> None:
        self.trainer.replicas = None
        group, self.group = self.group, None
        leave_group(group)
        del group
        gc.collect()

    def _superseded(self, generation: Generation) -> bool:
        current = current_generation(self.session.state, POLICY_GROUP)
        return current is not None and current.number > generation.number

    def regroup(self, generation: Generation) -> None:
        """Join `generation` of the policy group and agree on the training state; report.

        Local rank `i` joins the group of every replica's rank `i` (a group per local rank,
        where the replicas' ranks `i` hold the same shards)."""
        name = self.session.name
        if self._share(self._superseded(generation) if self.lead else None):
            return  # a newer regroup command follows
        if self.generation is not None and generation.number == self.generation.number:
            if self.in_sync:  # a restarted controller asks again
                self._report(self._regrouped())
            return
        rank = generation.rank_of(name)
        assert rank is not None, f"{name} is not in policy group generation {generation.number}"
        self._leave_group()
        self.generation, self.in_sync = generation, False
        outcome: str | None = None  # None: joined; "cancelled"; else the error
        try:
            if generation.world_size > 1:
                self.group = build_group(
                    generation.rendezvous(self.session.state.redis, part=f"l{self.local_rank}"),
                    rank=rank,
                    backend=self.backend,
                    timeout=self.timeout,
                    cancelled=lambda: self._superseded(generation),
                )
                replicas = ReplicaGroup(self.group, siblings=self.siblings)
                self.version = replicas.sync_state(
                    self.model,
                    self.trainer.optimizer,
                    self.trainer.scheduler,
                    version=self.version,
                    clean=self.clean,
                    ema=self.trainer.ema,  # (a language model's or a world model's averages)
                )
                self.trainer.replicas = replicas
            elif not self.clean:
                raise CollectiveError(
                    "the only policy replica left failed in the middle of a step's optimiser "
                    "updates; resume the job from a checkpoint"
                )
        except GroupCancelled:
            outcome = "cancelled"
        except (CollectiveError, TimeoutError) as err:
            outcome = str(err) or type(err).__name__
        outcomes = [o for o in self._gather(outcome) if o is not None]
        if outcomes:  # (any rank's failure is the replica's)
            self._leave_group()
            errors = [o for o in outcomes if o != "cancelled"]
            if not errors:
                return
            log.warning("joining policy group generation %d failed: %s", generation.number, errors)
            self._report(
                {
                    "type": "regroup_failed",
                    "generation": generation.number,
                    "rank": rank,
                    "error": errors[0],
                }
            )
            return
        self.clean, self.in_sync = True, True
        log.info(
            "policy group generation %d: rank %d of %d at version %d",
            generation.number,
            rank,
            generation.world_size,
            self.version,
        )
        self._report(self._regrouped())
        self._regrouped_weights()

    def _regrouped_weights(self) -> None:
        """After a regroup: the state may have moved on (a sync, or a step whose push failed),
        so the rollouts get it."""
        weights = self._share(current_generation(self.session.state, KIND) if self.lead else None)
        self.weights.refresh(self.pushed_weights, self.version, generation=weights)
        self.weights.push(self.pushed_weights(), self.version)

    def _stepped_weights(self, *, push: bool) -> None:
        """After a step: push the new weights to the rollouts when the command says so."""
        if push:
            self.weights.push(self.pushed_weights(), self.version)

    def _report(self, result: dict[str, Any]) -> None:
        """Hand `result` to the controller, signed with this replica's name (rank 0 only)."""
        if self.lead:
            self.session.state.push_result({**result, "name": self.session.name})

    def _regrouped(self) -> dict[str, Any]:
        assert self.generation is not None
        last = self.last_result
        return {
            "type": "regrouped",
            "generation": self.generation.number,
            "rank": self.rank,
            "version": self.version,
            # The completed step's result, if this state is that step's.
            "last_result": last if last is not None and last["step"] == self.version else None,
        }

    # -- training -------------------------------------------------------------------------------

    def _batch(self, command: dict[str, Any]) -> list[RolloutGroup]:
        """The step's scored groups, in the command's order (read by rank 0, handed to all)."""
        groups = None
        if self.lead:
            by_id = {g.prompt.prompt_id: g for g in self.session.state.inflight_batch()}
            missing = [i for i in command["prompt_ids"] if i not in by_id]
            if missing:
                raise RuntimeError(f"step {command['step']}: {missing} are not in flight")
            groups = [by_id[i] for i in command["prompt_ids"]]
        return self._share(groups)

    def _media(self, groups: list[RolloutGroup]) -> list[VisionInputs | None] | None:
        """A vision-language model's images and videos of each group's prompt, built from the
        prompt as the rollout built them (`batching.rollout_media`); None for a language model."""
        if self.vision is None:
            return None
        prompts = []
        for group in groups:
            if group.prompt.prompt is None:  # train.local_dataset: the row is read here too
                self._rows = self._rows if self._rows is not None else rl_rows(self.cfg)
                prompts.append(self._rows[group.prompt.index][self.cfg.grpo.prompt_column_name])
            else:
                prompts.append(group.prompt.prompt)
        return rollout_media(
            self.vision, groups, prompts, system_prompt=self.cfg.grpo.system_prompt
        )

    def train(self, command: dict[str, Any]) -> None:
        """Train this replica's share of the step in flight; report the result or the failure."""
        current = self.generation is not None and command["generation"] == self.generation.number
        if not (current and self.in_sync):
            return  # a superseded generation's: the controller re-issues the step after a regroup
        step = command["step"]
        if step <= self.version:  # trained already: the command was sent again
            if self.last_result is not None and self.last_result["step"] == step:
                self._report({**self.last_result, "generation": command["generation"]})
            return
        groups = self._batch(command)
        before = self.optimizer_steps
        start = time.perf_counter()
        error: str | None = None
        try:
            metrics = self.trainer.grpo_step(groups, self._media(groups))
        except CollectiveError as err:
            error = str(err) or type(err).__name__
        except GroupsLost as err:  # (every rank, before any update: nothing to undo)
            log.warning("step %d: %s; handing it back", step, err)
            self._report(
                {
                    "type": "train_lost",
                    "generation": command["generation"],
                    "step": step,
                    "attempt": command.get("attempt"),
                    "rank": self.rank,
                    "lost": err.prompt_ids,
                }
            )
            return
        outcomes = self._gather((error, self.optimizer_steps - before))
        errors = [e for e, _ in outcomes if e is not None]
        if errors:  # (any rank's failure is the replica's)
            self._step_failed(command, [n for _, n in outcomes], errors[0])
            return
        train_time = time.perf_counter() - start
        if self.backend == "nccl":  # (on CUDA; this rank's peak: the record shows rank 0's)
            metrics = {**metrics, "gpu_memory_peak_gb": torch.cuda.max_memory_allocated() / 1e9}
        self.profiler.step()
        self.version = step
        self._stepped_weights(push=command["push_weights"])
        if command["checkpoint"]:
            self.checkpointer.save(step, data={})
        self.last_result = {
            "type": "train",
            "generation": command["generation"],
            "rank": self.rank,
            "step": step,
            "prompt_ids": command["prompt_ids"],
            "metrics": metrics,
            "train_time": train_time,
        }
        self._report(self.last_result)

    def _step_failed(self, command: dict[str, Any], updates: list[int], error: str) -> None:
        """A collective of step `command["step"]` failed after `updates` optimiser updates
        (per rank of the replica)."""
        step = command["step"]
        self.trainer.optimizer.zero_grad(set_to_none=True)
        planned = self.trainer.planned_updates
        if all(n == 0 for n in updates):
            pass  # the state is the one before the step
        elif all(n == planned for n in updates):  # only the metric sums failed
            self.version = step
        else:
            self.clean = False
        log.warning(
            "step %d failed after %s optimiser update(s): %s; waiting for a regroup",
            step,
            "/".join(map(str, updates)),
            error,
        )
        self.in_sync = False
        self._leave_group()
        self._report(
            {
                "type": "train_failed",
                "generation": command["generation"],
                "rank": self.rank,
                "step": step,
                "error": error,
            }
        )

    def stop(self) -> None:
        """Finish pushes and checkpoints, export (policy rank 0's ranks), confirm."""
        self.profiler.close()
        self.checkpointer.close()
        self.weights.close()
        if self.rank == 0 and self.cfg.train.ckpt.export_safetensors:
            export = Path(self.meta["run_dir"]) / "safetensors" / "final"
            # (a collective of the replica's ranks when the model is split; rank 0 writes)
            self._export(export)
            if self.lead:
                log.info("exported the final weights to %s", export)
        self._leave_group()
        self._report({"type": "stopped", "rank": self.rank})


def language_policy(session: ReplicaSession, device: torch.device) -> PolicyModel:
    """The tokenizer, model, processor, trainer and export of a language or vision-language
    policy."""
    cfg = session.cfg
    tokenizer = load_tokenizer(cfg.policy.model_name_or_path, revision=cfg.policy.model_revision)
    # Every rank of every replica loads the same weights with the same seed, so replicas
    # start identical; in train.master_dtype, the optimiser's copy (forward runs in
    # param_dtype). The reference only runs forward: copied before the blocks are
    # checkpointed, compiled or split.
    hf_model = load_policy_model(cfg, device=device, seed=cfg.train.seed or 0)
    config: Any = hf_model.config
    vision = vision_processor(cfg.policy, config)
    ref = copy.deepcopy(hf_model) if cfg.grpo.kl_beta > 0 else None
    split = parallelize_policy(hf_model, cfg)
    trainer = PolicyTrainer(
        split.model,
        cfg,
        total_steps=session.meta["total_steps"],
        pad_id=tokenizer.pad_token_id,
        ref_model=None if ref is None else parallelize_reference(ref, split, cfg),
        data_parallel=split.data_parallel,
    )
    # (with train.ema_enable, the weight averages beside each export: `<folder>_ema`)
    export = with_ema_export(
        functools.partial(export_hf, hf_model, vision or tokenizer, parallel=trainer.parallel),
        trainer.ema,
    )
    lora = cfg.policy.lora is not None
    return PolicyModel(
        hf_model,
        trainer,
        export,
        saved=trainer.model,
        ema=trainer.ema,
        pushed_weights=functools.partial(pushed_weights, hf_model) if lora else None,
        generated_weights=functools.partial(rollout_weights, hf_model) if lora else None,
        trainable_only=lora,
        tokenizer=tokenizer,
        vision=vision,
    )


def run_policy(
    session: ReplicaSession, *, device: torch.device, build: PolicyBuilder | None = None
) -> None:
    """Body of a policy replica process (one of its ranks); `build` makes what it trains
    (default: a language model's, :func:`language_policy`)."""
    PolicyWorker(session, device=device, build=build).run()
