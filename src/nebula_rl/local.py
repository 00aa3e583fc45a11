"""A language model's run inside one job: RL in this process (`--local`) and SFT (one process or
its ranks), as steps of `policy.loop.train_steps`, the loop world models' runs share.

`run(cfg)` trains one model: for RL each step generates (the rollout engine), scores (the reward
functions) and trains; for SFT each step trains on tokenised conversations. It writes `metrics.jsonl` (one object per step) and a Hugging Face export under
the run folder. It is the quickest way to try a config, and the reference the multi-process run
is compared against. Simplification: rollouts here are always on-policy (generation waits for
the step), so `allowed_outdated_steps` has no effect in this mode.

SFT validation computes the loss on the validation rows (`val_loss`) every `validation.freq`
steps, after the last, and with `val_before_train` before the first (a record of its own, step 0).
RL validation (`[validation]`, see `nebula_rl.utils.validation`) runs on the engine after the step's
weights are loaded into it; its `val/*` numbers go into that step's record (before the first
step, with `val_before_train`, into a record of its own with `"step": 0`). When dynamic sampling
runs the prompts out before the last planned step, the last trained step is validated too.

With `train.ckpt.enable_checkpoint` it saves a checkpoint every `save_freq` steps (or at the end
of every `save_freq_in_epoch`-th epoch) and after the
last; `train.resume` continues from one, and the resumed run takes the same steps, losses and
samples as an uninterrupted one (on CPU in float32: bit for bit).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from nebula_rl.algorithms import dynamic_sampling_filter
from nebula_rl.config import Config, GrpoConfig, SftConfig
from nebula_rl.data import (
    epoch_order,
    num_train_steps,
    rl_prompt,
    rl_rows,
    rl_validation_rows,
    sft_example,
    sft_rows,
    split_rows,
    validate_rows,
)
from nebula_rl.data.sft_loader import SftBatches
from nebula_rl.data.vision import VisionProcessor, vision_processor
from nebula_rl.models import load_tokenizer
from nebula_rl.models.export import export_hf
from nebula_rl.policy.batching import rollout_media
from nebula_rl.policy.checkpoint import Checkpointer, resume_checkpoint
from nebula_rl.policy.ema import with_ema_export
from nebula_rl.policy.loop import train_steps
from nebula_rl.policy.setup import (
    load_policy_model,
    parallelize_policy,
    prepare_single_process,
    rollout_copy,
    rollout_weights,
    use_deterministic,
)
from nebula_rl.policy.teacher import Teacher
from nebula_rl.policy.trainer import PolicyTrainer, SftExample
from nebula_rl.protocol import Prompt, RolloutGroup
from nebula_rl.rewards import RemoteScorer, Scorer, filter_values, scorer
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import Engine, GenerationRequest, RequestOutput, SamplingParams
from nebula_rl.rollout.multiturn import Conversation, with_turn_rewards
from nebula_rl.rollout.text import (
    completion_texts,
    make_completions,
    multi_turn,
    prompt_inputs,
    sampling_params,
    validation_sampling_params,
)
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.utils.metrics_log import MetricsWriter
from nebula_rl.utils.profiling import StepProfiler
from nebula_rl.utils.ranks import cpu_threads, init_ranks
from nebula_rl.utils.runs import resolve_run_dir
from nebula_rl.utils.validation import validation_metrics, validation_seed

__all__ = ["run"]

log = logging.getLogger(__name__)


def run(cfg: Config) -> Path:
    """Train as configured in this process; returns the run folder."""
    distributed = _init_distributed(cfg)
    lead = not distributed or dist.get_rank() == 0
    seed = cfg.train.seed or 0
    torch.manual_seed(seed)
    run_dir = resolve_run_dir(cfg.train)
    if distributed:  # one folder for all ranks: rank 0's start time names it
        names = [str(run_dir)]
        dist.broadcast_object_list(names, src=0)
        run_dir = Path(names[0])
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    if distributed:
        dist.barrier()
    use_deterministic(cfg.train)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(cfg.policy.model_name_or_path, revision=cfg.policy.model_revision)
    # The weights the optimiser updates, in train.master_dtype; forward runs in param_dtype.
    model = load_policy_model(cfg, device=device, seed=seed)
    model_config: Any = model.config
    # A vision-language model's processor: its conversations' images and videos, and its export.
    vision = vision_processor(cfg.policy, model_config)
    policy = cfg.train.train_policy
    if isinstance(policy, GrpoConfig):
        trainer = _run_grpo(cfg, policy, model, tokenizer, run_dir, vision=vision)
    else:
        with cpu_threads(cfg.policy.cpu_threads):
            trainer = _run_sft(cfg, policy, model, tokenizer, run_dir, vision=vision)
    if cfg.train.ckpt.export_safetensors:  # (and the weight averages', `final_ema`)
        _export(model, vision or tokenizer, trainer)(run_dir / "safetensors" / "final")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return run_dir


def _init_distributed(cfg: Config) -> bool:
    """Join the process group of this job's ranks (started by `nebula-rl train` itself, see
    `nebula_rl.launch.run_ranks`, or by torchrun); whether there is one.

    Only SFT runs on several processes here: each data-parallel rank takes a share of every
    batch and the model is split by `[policy.parallelism]` (`parallelize_policy`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    if isinstance(cfg.train.train_policy, GrpoConfig):
        raise ValueError(
            "nebula-rl train --local runs RL in one process; without --local the job splits "
            "each policy replica over the ranks [policy.parallelism] asks for"
        )
    init_ranks("nccl" if torch.cuda.is_available() else "gloo")
    return True


class _PromptStream:
    """The prompts of all epochs in order; `epoch` and `position` are what a checkpoint saves."""

    def __init__(self, rows: list[dict[str, Any]], cfg: Config) -> None:
        self.rows, self.cfg = rows, cfg
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        return epoch_order(
            len(self.rows),
            epoch=self.epoch,
            shuffle=self.cfg.grpo.dataloader_shuffle,
            seed=self.cfg.grpo.dataloader_seed,
        )

    def take(self, n: int) -> list[Prompt]:
        """Up to `n` next prompts (fewer once the last epoch is exhausted)."""
        out: list[Prompt] = []
        order = self._order()
        while len(out) < n and self.epoch < self.cfg.train.epoch:
            chunk = order[self.position : self.position + n - len(out)]
            out += [rl_prompt(self.cfg.grpo, self.rows, epoch=self.epoch, index=i) for i in chunk]
            self.position += len(chunk)
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order()
        return out


def _generate(
    engine: Engine,
    tokenizer: Any,
    prompts: list[Prompt],
    cfg: Config,
    score: Scorer | RemoteScorer,
    sampling: list[SamplingParams],
    n: int,
    vision: VisionProcessor | None,
) -> list[tuple[Prompt, list[int], RequestOutput, list[str], list[Any]]]:
    """Generate `n` completions of each prompt (`sampling[i]` for prompt i), decode each once
    and score it: (prompt, its token ids, the output, the texts, the scores) per prompt.
    Multi-turn (`rollout.multi_turn_config.enable`): each completion is a conversation."""
    turns = multi_turn(cfg, tokenizer, vision)
    ids, requests = [], []
    conversations: list[list[Conversation] | None] = []
    for q, s in zip(prompts, sampling, strict=True):
        assert q.prompt is not None and q.reference is not None, "local prompts carry their text"
        if turns is not None:
            request, convs = turns.request(q.prompt, q.reference, n=n, sampling=s)
            ids.append(list(request.prompt_token_ids))
            requests.append(request)
            conversations.append(convs)
            continue
        q_ids, media = prompt_inputs(
            tokenizer, vision, q.prompt, system_prompt=cfg.grpo.system_prompt
        )
        ids.append(q_ids)
        requests.append(GenerationRequest(q_ids, n=n, sampling=s, media=media))
        conversations.append(None)
    out = []
    try:
        with cpu_threads(cfg.rollout.cpu_threads):
            outputs = engine.generate(requests)
    finally:
        if turns is not None:
            turns.executor.shutdown()
    for prompt, prompt_ids, output, chats in zip(prompts, ids, outputs, conversations, strict=True):
        texts = completion_texts(cfg.rollout, tokenizer, output, chats)
        lengths = [len(c.token_ids) for c in output.completions]
        assert prompt.reference is not None
        # (with remote rewards every group is sent at once, its scores collected below)
        scored: Any = (
            score.submit(texts, lengths, prompt.reference, group=prompt.prompt_id)
            if isinstance(score, RemoteScorer)
            else score.score_group(texts, lengths, prompt.reference)
        )
        out.append((prompt, prompt_ids, output, texts, scored))
    if isinstance(score, RemoteScorer):
        out = [(*rest, scored.result()) for *rest, scored in out]
    return [
        (
            prompt,
            prompt_ids,
            output,
            texts,
            with_turn_rewards(scored, [c.rewards for c in chats]) if chats else scored,
        )
        for (prompt, prompt_ids, output, texts, scored), chats in zip(
            out, conversations, strict=True
        )
    ]


def _rollout(
    engine: Engine,
    tokenizer: Any,
    prompts: list[Prompt],
    cfg: Config,
    score: Scorer | RemoteScorer,
    vision: VisionProcessor | None,
) -> list[RolloutGroup]:
    sampling = [sampling_params(cfg.rollout, tokenizer.eos_token_id)] * len(prompts)
    generated = _generate(
        engine, tokenizer, prompts, cfg, score, sampling, cfg.rollout.n_generation, vision
    )
    logprobs = cfg.grpo.collect_rollout_logprobs
    return [
        RolloutGroup(
            prompt, ids, make_completions(output, texts, scored, logprobs=logprobs), "local"
        )
        for prompt, ids, output, texts, scored in generated
    ]


def _validate(
    engine: Engine,
    tokenizer: Any,
    cfg: Config,
    rows: list[dict[str, Any]],
    score: Scorer | RemoteScorer,
    step: int,
    vision: VisionProcessor | None,
) -> dict[str, float]:
    """The `val/*` metrics of the engine's current weights on the validation `rows`."""
    v = cfg.validation
    prompts = [
        rl_prompt(cfg.grpo, rows, epoch=0, index=i, min_version=step, validation_step=step)
        for i in range(len(rows))
    ]
    rewards: list[float] = []
    lengths: list[int] = []
    versions: list[int] = []
    size = v.batch_size or cfg.rollout.batch_size
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        sampling = [
            validation_sampling_params(
                cfg, tokenizer.eos_token_id, seed=validation_seed(cfg, step, q.index)
            )
            for q in chunk
        ]
        for *_, output, _texts, scored in _generate(
            engine, tokenizer, chunk, cfg, score, sampling, v.n_generation, vision
        ):
            rewards += [s.reward for s in scored]
            lengths += [len(c.token_ids) for c in output.completions]
            versions += [c.policy_version for c in output.completions]
    return validation_metrics(rewards, lengths, versions)


def _export(model: torch.nn.Module, tokenizer: Any, trainer: PolicyTrainer) -> Any:
    """Writes Hugging Face exports of `model` into the folder it is given, and with
    `train.ema_enable` of its weight averages beside it (`<folder>_ema`)."""
    export = functools.partial(export_hf, model, tokenizer, parallel=trainer.parallel)
    return with_ema_export(export, trainer.ema)


def _checkpointer(
    cfg: Config,
    run_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    trainer: PolicyTrainer,
    engine: Engine | None = None,
) -> Checkpointer:
    return Checkpointer(
        cfg.train.ckpt,
        run_dir,
        model=trainer.model,  # (this rank's modules: under PP, its stages')
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        # (the built-in engine's sampling generator is saved; vLLM's is its own)
        engine=engine if isinstance(engine, TorchEngine) else None,
        ema=trainer.ema,
        export=_export(model, tokenizer, trainer),
        trainable_only=cfg.policy.lora is not None,
    )


def _collect_batch(
    engine: Engine,
    tokenizer: Any,
    prompts: _PromptStream,
    cfg: Config,
    score: Scorer | RemoteScorer,
    vision: VisionProcessor | None,
) -> tuple[list[RolloutGroup], float, int]:
    """A step's scored groups (refilled while dynamic sampling drops some), the generation
    time and the number of groups dropped. Fails when the dropped groups need more than
    `max_retry_for_on_policy` batches' worth of replacement prompts."""
    p = cfg.grpo
    size = cfg.groups_per_replica
    batch: list[RolloutGroup] = []
    gen_time, dropped = 0.0, 0
    while len(batch) < size:
        want = prompts.take(size - len(batch))
        if not want:
            break
        g0 = time.perf_counter()
        groups = _rollout(engine, tokenizer, want, cfg, score, vision)
        gen_time += time.perf_counter() - g0
        keep = (
            dynamic_sampling_filter(
                torch.tensor([filter_values(g.completions, p.filter_reward_metric) for g in groups])
            )
            if p.dynamic_sampling_enabled
            else torch.ones(len(groups), dtype=torch.bool)
        )
        batch += [g for g, k in zip(groups, keep.tolist(), strict=True) if k]
        dropped += int((~keep).sum())
        rounds = -(-dropped // size)
        if p.dynamic_sampling_enabled and 0 < p.max_retry_for_on_policy < rounds:
            raise RuntimeError(
                f"dynamic sampling dropped {dropped} groups while filling one step's batch "
                f"({rounds} rounds of {size} replacement prompts), more than "
                f"train.train_policy.max_retry_for_on_policy = {p.max_retry_for_on_policy}: the "
                "rewards barely vary; check the reward functions or raise the limit"
            )
    return batch, gen_time, dropped


def _run_grpo(
    cfg: Config,
    p: GrpoConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    run_dir: Path,
    *,
    vision: VisionProcessor | None = None,
) -> PolicyTrainer:
    """RL in this process, by the trainer it returns; `vision`: a vision-language model's
    processor."""
    steps = _GrpoSteps(cfg, p, model, tokenizer, run_dir, vision=vision)
    try:
        train_steps(
            steps,
            cfg,
            start=steps.start,
            checkpointer=steps.checkpointer,
            writer=MetricsWriter(cfg, run_dir, after_step=steps.start, total_steps=steps.total),
            profiler=StepProfiler(cfg.profiler, run_dir, name="local"),
        )
    finally:
        steps.close()
    (run_dir / "trained_prompts.json").write_text(json.dumps(steps.trained))
    return steps.trainer


class _GrpoSteps:
    """RL steps in this process: generate and score a batch with the engine, step the
    trainer, load its weights into the engine."""

    on_signal: Literal["stop", "continue"] | None = (
        "continue"  # (RL goes on after the checkpoint, as in cosmos-rl)
    )

    def __init__(
        self,
        cfg: Config,
        p: GrpoConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        run_dir: Path,
        *,
        vision: VisionProcessor | None,
    ) -> None:
        self.cfg, self.p, self.model, self.tokenizer, self.vision = cfg, p, model, tokenizer, vision
        rows = rl_rows(cfg)
        self.total = num_train_steps(cfg.train, len(rows), items_per_step=cfg.groups_per_replica)
        self.steps_per_epoch = len(rows) // cfg.groups_per_replica
        self.score = scorer(cfg)
        self.val_rows = rl_validation_rows(cfg) if cfg.validation.enable else []
        self.val_score = scorer(cfg, validation=True) if cfg.validation.enable else self.score
        # The reference is the starting model, also when resuming: copy it before a checkpoint
        # loads (and before the blocks are checkpointed or compiled: it only runs forward).
        ref = copy.deepcopy(model).eval().requires_grad_(False) if p.kl_beta > 0 else None
        # The engine decodes its own copy, in param_dtype; after each step it takes the new
        # weights in place.
        self.engine = build_engine(
            cfg,
            model=rollout_copy(model, cfg.train),
            tokenizer=tokenizer,
            seed=cfg.rollout.seed if cfg.rollout.seed is not None else cfg.train.seed or 0,
        )
        prepare_single_process(model, cfg)
        # On-policy distillation: the teacher scores each step's groups in this process.
        self.teacher = (
            Teacher(cfg, device=next(model.parameters()).device)
            if cfg.distillation.enable
            else None
        )
        self.trainer = PolicyTrainer(
            model, cfg, total_steps=self.total, pad_id=tokenizer.pad_token_id, ref_model=ref
        )
        self.checkpointer = _checkpointer(
            cfg, run_dir, model, vision or tokenizer, self.trainer, self.engine
        )
        self.prompts = _PromptStream(rows, cfg)
        self.trained: list[str] = []
        self.start = 0
        restored = resume_checkpoint(cfg.train, run_dir, self.checkpointer)
        if restored is not None:
            self.start, self.trained = restored.step, restored.data["trained_prompts"]
            self.prompts.epoch = restored.data["epoch"]
            self.prompts.position = restored.data["position"]
            self.engine.update_weights(rollout_weights(model), policy_version=self.start)

    def step(self, step: int) -> dict[str, Any] | None:
        cfg, p, vision = self.cfg, self.p, self.vision
        t0 = time.perf_counter()
        batch, gen_time, dropped = _collect_batch(
            self.engine, self.tokenizer, self.prompts, cfg, self.score, vision
        )
        if not batch:
            return None
        t_teacher = time.perf_counter()
        if self.teacher is not None:
            batch = self.teacher.score(batch)
        teacher_time = time.perf_counter() - t_teacher
        media = None if vision is None else _batch_media(vision, batch, p)
        t_train = time.perf_counter()
        with cpu_threads(cfg.policy.cpu_threads):
            metrics = self.trainer.grpo_step(batch, media)
        t_update = time.perf_counter()
        self.engine.update_weights(rollout_weights(self.model), policy_version=step)
        update_time = time.perf_counter() - t_update
        self.trained = self.trained + [g.prompt.prompt_id for g in batch]
        times = {
            "step_time": time.perf_counter() - t0,
            "generate_time": gen_time,
            **({"teacher_time": teacher_time} if self.teacher is not None else {}),
            "train_time": t_update - t_train,
            "weight_update_time": update_time,
        }
        return _step_record(step, metrics, batch, dropped, times)

    def validate(self, step: int) -> dict[str, float]:
        return _validate(
            self.engine, self.tokenizer, self.cfg, self.val_rows, self.val_score, step, self.vision
        )

    def recorded(self, step: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        position = {"epoch": self.prompts.epoch, "position": self.prompts.position}
        return {**position, "trained_prompts": self.trained}

    def close(self) -> None:
        """Close the reward service's clients."""
        for s in {id(self.score): self.score, id(self.val_score): self.val_score}.values():
            if isinstance(s, RemoteScorer):
                s.close()


def _batch_media(vision: VisionProcessor, batch: list[RolloutGroup], p: GrpoConfig) -> Any:
    """The media of a vision-language batch's prompts, for the policy's forward."""
    texts = [g.prompt.prompt for g in batch]
    assert all(t is not None for t in texts), "local prompts carry their text"
    return rollout_media(vision, batch, cast(list[Any], texts), system_prompt=p.system_prompt)


def _step_record(
    step: int,
    metrics: dict[str, float],
    batch: list[RolloutGroup],
    dropped: int,
    times: dict[str, float],
) -> dict[str, Any]:
    """A step's metrics record: the trainer's, the (zero) staleness, the times (seconds) and
    the rollout's throughput."""
    num_gen_tokens = sum(len(c.token_ids) for g in batch for c in g.completions)
    record: dict[str, Any] = {
        "step": step,
        "policy_version": step,
        **metrics,
        "staleness_mean": 0.0,
        "staleness_max": 0,
        "groups_dropped": dropped,
        **times,
        "rollout_tokens_per_s": num_gen_tokens / max(times["generate_time"], 1e-9),
    }
    if torch.cuda.is_available():  # (policy, optimiser and engine: this process)
        record["gpu_memory_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return record


class _SftTokenize:
    """A row's (token ids, assistant mask), truncated to the model length; with a
    vision-language model's processor, also its media (picklable, for dataloader worker
    processes)."""

    def __init__(
        self, cfg: Config, p: SftConfig, tokenizer: Any, vision: VisionProcessor | None = None
    ) -> None:
        self.p, self.tokenizer, self.max_length = p, tokenizer, cfg.policy.model_max_length
        self.vision = vision

    def __call__(self, row: dict[str, Any]) -> SftExample:
        p = self.p
        if p.prompt_column_name and p.response_column_name:
            messages = [
                {"role": "user", "content": row[p.prompt_column_name]},
                {"role": "assistant", "content": str(row[p.response_column_name])},
            ]
        else:
            messages = row[p.conversation_column_name]
        if self.vision is not None:
            inputs, mask = self.vision.sft_example(
                messages, system_prompt=p.system_prompt, max_length=self.max_length
            )
            return inputs.input_ids, mask, inputs
        return sft_example(
            self.tokenizer, messages, system_prompt=p.system_prompt, max_length=self.max_length
        )


def _sft_rows(cfg: Config, p: SftConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, validation rows) with the configured columns; the validation rows come
    from `validation.dataset`, else from the training dataset's held-out `test_size` part, and
    are empty when validation is off."""
    by_columns = bool(p.prompt_column_name and p.response_column_name)
    columns = (
        [p.prompt_column_name, p.response_column_name]
        if by_columns
        else [p.conversation_column_name]
    )
    seed = cfg.train.seed or 0
    conversations = "" if by_columns else p.conversation_column_name
    rows, _ = validate_rows(
        sft_rows(p.dataset, conversations, key="train.train_policy.dataset", seed=seed),
        columns=columns,
    )
    train, held_out = split_rows(rows, p.dataset.test_size, seed=seed)
    v = cfg.validation
    if not v.enable:
        return train, []
    if v.dataset.name:
        held_out, _ = validate_rows(
            sft_rows(v.dataset, conversations, key="validation.dataset", seed=seed),
            columns=columns,
        )
    if not held_out:
        raise ValueError(
            "validation.enable: no validation rows; set validation.dataset.name or "
            "train.train_policy.dataset.test_size"
        )
    return train, held_out[: v.max_num_prompts]


def _run_sft(
    cfg: Config,
    p: SftConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    run_dir: Path,
    *,
    vision: VisionProcessor | None = None,
) -> PolicyTrainer:
    """The SFT loop, by the trainer it returns (its `parallel`: the ParallelModel the model
    became under torchrun, None in one process). `vision`: a vision-language model's processor
    (conversations with images and videos)."""
    steps = _SftSteps(cfg, p, model, tokenizer, run_dir, vision=vision)
    lead = not dist.is_initialized() or dist.get_rank() == 0  # (TP ranks share dp_rank 0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    train_steps(
        steps,
        cfg,
        start=steps.start,
        checkpointer=steps.checkpointer,
        writer=(
            MetricsWriter(cfg, run_dir, after_step=steps.start, total_steps=steps.total)
            if lead
            else None
        ),
        profiler=StepProfiler(cfg.profiler, run_dir, name="sft", rank=rank),
    )
    return steps.trainer


class _SftSteps:
    """SFT steps: `train_batch_per_replica` conversations per data-parallel rank (as in
    cosmos-rl), split by [policy.parallelism] under torchrun (data-parallel ranks take shares of
    every batch; TP, PP and CP ranks of one data-parallel rank take the same); the trainer
    normalises by the global token count, so a step is that of the whole batch."""

    on_signal: Literal["stop", "continue"] | None = (
        "stop"  # (save, then stop, as cosmos-rl's SFT does)
    )

    def __init__(
        self,
        cfg: Config,
        p: SftConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        run_dir: Path,
        *,
        vision: VisionProcessor | None,
    ) -> None:
        self.cfg, self.p = cfg, p
        train_rows, val_rows = _sft_rows(cfg, p)
        tokenize = _SftTokenize(cfg, p, tokenizer, vision)
        self.batches = SftBatches(
            train_rows,
            tokenize,
            num_workers=p.dataloader_num_workers,
            prefetch_factor=p.dataloader_prefetch_factor,
        )
        val_examples = [tokenize(row) for row in val_rows]
        policy = parallelize_policy(model, cfg)
        self.dp_rank, self.dp_size = policy.dp_rank, policy.dp_size
        self.size = size = cfg.train.train_batch_per_replica * self.dp_size
        self.num_rows = len(train_rows)
        self.steps_per_epoch = (
            self.num_rows // size if p.dataloader_drop_last else -(-self.num_rows // size)
        )
        self.total = num_train_steps(cfg.train, self.steps_per_epoch * size, items_per_step=size)
        self.val_examples = val_examples[self.dp_rank :: self.dp_size]
        self.trainer = PolicyTrainer(
            policy.model,
            cfg,
            total_steps=self.total,
            pad_id=tokenizer.pad_token_id,
            data_parallel=policy.data_parallel,
        )
        self.checkpointer = _checkpointer(cfg, run_dir, model, vision or tokenizer, self.trainer)
        self.start, first_epoch, first_position = 0, 0, 0
        restored = resume_checkpoint(cfg.train, run_dir, self.checkpointer)
        if restored is not None:
            self.start = restored.step
            first_epoch, first_position = restored.data["epoch"], restored.data["position"]
        self.epoch, self.position = first_epoch, first_position
        self._next = self._batches(first_epoch, first_position)

    def _batches(self, first_epoch: int, first_position: int) -> Iterator[tuple[int, int, Any]]:
        """(epoch, position after the batch, batch) of the steps after `start`."""
        cfg, p, size, taken = self.cfg, self.p, self.size, self.start
        for epoch in range(first_epoch, cfg.train.epoch):
            order = epoch_order(
                self.num_rows, epoch=epoch, shuffle=p.dataloader_shuffle, seed=p.dataloader_seed
            )
            first = first_position if epoch == first_epoch else 0
            last = min(self.steps_per_epoch * size, first + (self.total - taken) * size)
            for position, batch in self.batches.epoch(
                order, start=first, stop=last, size=size, dp_rank=self.dp_rank,
                dp_size=self.dp_size,
            ):  # fmt: skip
                taken += 1
                yield epoch, position, batch

    def step(self, step: int) -> dict[str, Any] | None:
        taken = next(self._next, None)
        if taken is None:
            return None
        self.epoch, self.position, batch = taken
        t0 = time.perf_counter()
        metrics = self.trainer.sft_step(batch)
        return {"step": step, "epoch": self.epoch, **metrics, "step_time": time.perf_counter() - t0}

    def validate(self, step: int) -> dict[str, float]:
        if not self.val_examples:  # (a data-parallel rank without a share of them)
            return {}
        rows = self.cfg.validation.batch_size or self.p.mini_batch
        return {"val_loss": self.trainer.sft_eval(self.val_examples, rows_per_forward=rows)}

    def recorded(self, step: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}
