"""Colocated replica (`mode = "colocated"`, language models): a policy replica whose ranks also
generate, taking turns with training, with the same controller, ledger and algorithms as
disaggregated mode.

The replica is a :class:`~nebula_rl.policy.worker.PolicyWorker` (regroups, `train` commands,
checkpoints, export: all unchanged) whose loop, between commands, runs generation rounds:

1. rank 0 claims up to `rollout.batch_size` prompts from the job's streams (validation prompts
   first), exactly as a rollout replica does, and hands them to the replica's ranks;
2. if the weights changed since the last round (a step, a regroup), every rank copies the
   policy's weights into its engine (sharded parameters are gathered whole: one all-gather per
   parameter per step, the traffic of one forward pass);
3. rank `r` of `n` generates prompts `r, r + n, ...` with its own engine (the built-in torch
   engine, `rollout.backend = "torch"` or cosmos-rl's `"example_hf"`), rank 0 collects the
   outputs, scores them and pushes each group before acknowledging its prompt.

So completions go back through the controller as in disaggregated mode: a crashed colocated
replica loses no prompt (its claims are requeued), the controller judges staleness and forms the
batch, and the step's `train` command comes like any other. A `train` command waits for the
round in progress (at most `rollout.batch_size` prompts) and is taken before the next one.

Why the engine decodes its own copy of the weights rather than the training module: the
training module is in `train.master_dtype`, possibly FSDP2-sharded, checkpointed and compiled,
while the engine decodes in `train.param_dtype` and fuses q/k/v and gate/up into one matmul by
re-pointing its parameters at a fused buffer, which the optimiser's parameters cannot be. The
copy costs the model once in `param_dtype` per rank (no optimiser state, no gradients) and one
in-place copy per step; no weights cross process boundaries. Generation is then a plain,
synchronous `engine.generate` on each rank, so the ranks need no lock step, and replica 1's rank
0 samples exactly as `nebula-rl train --local` does (same seed, same batches).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.data import rl_rows, rl_validation_rows
from nebula_rl.models import load_model, resolve_dtype
from nebula_rl.policy.setup import rollout_weights
from nebula_rl.policy.worker import PolicyWorker
from nebula_rl.protocol import Completion, Prompt
from nebula_rl.rewards import Scored, filter_values, scorer
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import GenerationRequest, RequestOutput
from nebula_rl.rollout.multiturn import with_turn_rewards
from nebula_rl.rollout.worker import (
    InlineExecutor,
    close_scorers,
    completion_texts,
    hand_in,
    make_completions,
    multi_turn,
    prompt_inputs,
    sampling_params,
    submit_scoring,
    validation_sampling_params,
)
from nebula_rl.utils.ranks import cpu_threads
from nebula_rl.utils.validation import validation_seed
from nebula_rl.weights.transport import NamedTensors

__all__ = ["ColocatedWorker", "run_colocated"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Work:
    """A claimed prompt, ready to generate: its stream id, the prompt, its text and reference
    answer, and the request every rank can run (multi-turn: without its continuation, which
    the generating rank makes for itself)."""

    msg_id: str
    prompt: Prompt
    text: str | list[dict[str, Any]]
    reference: str
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class _Generated:
    """What a rank generated for one request: the output, the texts the reward functions
    score, and each sample's per-turn rewards (multi-turn; None for single-turn)."""

    output: RequestOutput
    texts: list[str]
    turn_rewards: list[list[float]] | None


class ColocatedWorker(PolicyWorker):
    """One colocated replica (this process: one of its ranks); see the module docstring."""

    def __init__(self, session: ReplicaSession, *, device: torch.device) -> None:
        super().__init__(session, device=device)
        cfg = self.cfg
        # The starting weights are copied in from the policy before the first round.
        model = load_model(
            cfg.policy.model_name_or_path,
            dtype=resolve_dtype(cfg.train.param_dtype),
            device=device,
            seed=cfg.train.seed or 0,
            revision=cfg.policy.model_revision,
        )
        base = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.train.seed or 0
        replica = session.registration["replica_id"] - 1  # (ids count from 1)
        self.engine = build_engine(
            cfg,
            model=model,
            tokenizer=self.tokenizer,
            seed=base + 1000 * replica + self.local_rank,
        )
        self._stale = True
        """Whether the engine's weights lag the policy's."""
        self.rollout_weights: Callable[[], NamedTensors] = (
            functools.partial(rollout_weights, self.hf_model)
            if cfg.policy.lora is not None
            else self.model.named_parameters
        )
        """This rank's weights as the engine holds them (a LoRA policy's merged, under the plain
        names; `policy.setup.rollout_weights`)."""
        self.multi_turn = multi_turn(cfg, self.tokenizer, self.vision)
        """Multi-turn conversations (`rollout.multi_turn_config`): every rank runs the
        environments of the samples it generates."""
        if self.lead:
            self.sampling = sampling_params(cfg, self.tokenizer.eos_token_id)
            groups = max(1, cfg.rollout.batch_size)  # (a round's groups score at once)
            self.scorer = scorer(cfg, max_groups=groups)
            self.val_scorer = (
                scorer(cfg, validation=True, max_groups=groups) if cfg.validation.enable else None
            )
            local = cfg.train.local_dataset  # (prompts come as indices: read the rows here)
            self.rows = rl_rows(cfg) if local else None
            self.val_rows = rl_validation_rows(cfg) if local and cfg.validation.enable else None
            workers = cfg.rollout.reward_workers
            self.pool: Executor = (
                ProcessPoolExecutor(workers, mp_context=torch.multiprocessing.get_context("spawn"))
                if workers > 0
                else InlineExecutor()
            )

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Carry out commands until `stop` or the end of the job, generating in between."""
        session = self.session
        session.policy_version = lambda: self.version
        session.start_heartbeats()
        session.mark_ready()
        busy = False
        try:
            while True:
                tick = self._tick(block_ms=0 if busy else 100)
                if tick.finished is not None:
                    return
                if self.run_commands(tick.commands):
                    return
                if tick.commands:  # (look for more before generating)
                    busy = True
                    continue
                busy = self.in_sync and self.clean and self.generate_round()
        finally:
            if self.multi_turn is not None:
                self.multi_turn.executor.shutdown(wait=False, cancel_futures=True)
            if self.lead:
                self.pool.shutdown(wait=False, cancel_futures=True)
                close_scorers(self.scorer, self.val_scorer)

    def _regrouped_weights(self) -> None:
        self._stale = True  # (the state agreed with the group may be another replica's)

    def _stepped_weights(self, *, push: bool) -> None:
        self._stale = True  # (there are no rollout replicas to push to)

    # -- generation -----------------------------------------------------------------------------

    def generate_round(self) -> bool:
        """Claim prompts, generate them on every rank, score and push them (see the module
        docstring); whether there were any."""
        work = self._share(self._claim() if self.lead else None)
        if not work:
            return False
        if self._stale:
            self._load_policy_weights()
        rank, ranks = self.local_rank, self.num_ranks
        mine = work[rank::ranks]
        shares = self._gather(self._generate(mine) if mine else [])
        if self.lead:
            ordered = [shares[i % ranks][i // ranks] for i in range(len(work))]
            self._push(work, ordered)
        return True

    def _generate(self, work: list[_Work]) -> list[_Generated]:
        """Generate `work` on this rank's engine (multi-turn: with conversations of its own)
        and decode what the reward functions score."""
        requests, chats = [], []
        for w in work:
            conversations = None
            request = w.request
            if self.multi_turn is not None:
                r = w.request
                request, conversations = self.multi_turn.request(
                    w.text, w.reference, n=r.n, sampling=r.sampling
                )
            requests.append(request)
            chats.append(conversations)
        with cpu_threads(self.cfg.rollout.cpu_threads):
            outputs = self.engine.generate(requests)
        return [
            _Generated(
                output,
                completion_texts(self.cfg, self.tokenizer, output, conversations),
                None if conversations is None else [c.rewards for c in conversations],
            )
            for output, conversations in zip(outputs, chats, strict=True)
        ]

    def _load_policy_weights(self) -> None:
        """Copy the policy's weights into the engine (a collective of the replica's ranks when
        the parameters are sharded: each is gathered whole)."""

        def full(tensor: torch.Tensor) -> torch.Tensor:
            gather = getattr(tensor, "full_tensor", None)  # (a DTensor shard)
            return gather() if gather is not None else tensor

        with torch.no_grad():
            named = self.rollout_weights()  # (a LoRA policy's: merged, under the plain names)
            pairs = named.items() if isinstance(named, Mapping) else named
            weights = ((name, full(p.detach())) for name, p in pairs)
            self.engine.update_weights(weights, policy_version=self.version)
        self._stale = False

    def _claim(self) -> list[_Work]:
        """Rank 0: up to `rollout.batch_size` prompts, validation prompts first; a prompt that
        cannot be generated (too long, a bad image) is pushed back at once as an error group."""
        r, v = self.cfg.rollout, self.cfg.validation
        state, name = self.session.state, self.session.name
        claimed: list[tuple[str, Prompt]] = []
        if self.val_scorer is not None:
            claimed += state.claim_validation(name, v.batch_size or r.batch_size)
        if len(claimed) < r.batch_size:
            block_ms = 0 if claimed else 100
            claimed += state.claim_prompts(name, r.batch_size - len(claimed), block_ms=block_ms)
        work = []
        for msg_id, prompt in claimed:
            assert prompt.min_version <= self.version, (
                f"prompt {prompt.prompt_id} needs weights of version {prompt.min_version}; this "
                f"replica holds {self.version}"
            )
            text, reference = self._text(prompt)
            n, sampling = r.n_generation, self.sampling
            if prompt.validation_step is not None:
                seed = validation_seed(self.cfg, prompt.validation_step, prompt.index)
                n = v.n_generation
                sampling = validation_sampling_params(
                    self.cfg, self.tokenizer.eos_token_id, seed=seed
                )
            try:
                if self.multi_turn is not None:  # (checked as the ranks will make it)
                    request, _ = self.multi_turn.request(text, reference, n=n, sampling=sampling)
                    request = dataclasses.replace(request, continuation=None)
                else:
                    ids, media = prompt_inputs(
                        self.tokenizer,
                        self.vision,
                        text,
                        system_prompt=self.cfg.grpo.system_prompt,
                    )
                    request = GenerationRequest(ids, n=n, sampling=sampling, media=media)
                self.engine.validate(request)
            except ValueError as err:
                log.error("prompt %s cannot be generated: %s", prompt.prompt_id, err)
                self._send(msg_id, prompt, [], [], filtered=True, error=str(err))
                continue
            work.append(_Work(msg_id, prompt, text, reference, request))
        return work

    def _text(self, prompt: Prompt) -> tuple[str | list[dict[str, Any]], str]:
        """The prompt's text and reference: as sent, or from this replica's own rows."""
        if prompt.prompt is not None and prompt.reference is not None:
            return prompt.prompt, prompt.reference
        rows = self.rows if prompt.validation_step is None else self.val_rows
        assert rows is not None, f"prompt {prompt.prompt_id} comes without its text"
        row = rows[prompt.index]
        p = self.cfg.grpo
        return row[p.prompt_column_name], str(row[p.response_column_name])

    def _push(self, work: list[_Work], generated: list[_Generated]) -> None:
        """Rank 0: score and push each group, then acknowledge its prompt."""
        scoring = []
        for w, g in zip(work, generated, strict=True):
            texts, output = g.texts, g.output
            lengths = [len(c.token_ids) for c in output.completions]
            score = self.scorer if w.prompt.validation_step is None else self.val_scorer
            assert score is not None
            pending = submit_scoring(
                score, self.pool, texts, lengths, w.reference, group=w.prompt.prompt_id
            )
            scoring.append((texts, pending))
        p = self.cfg.grpo
        for w, g, (texts, pending) in zip(work, generated, scoring, strict=True):
            output = g.output
            scored: list[Scored] = pending.result()
            if g.turn_rewards is not None:
                scored = with_turn_rewards(scored, g.turn_rewards)
            validating = w.prompt.validation_step is not None
            logprobs = p.collect_rollout_logprobs and not validating
            completions = make_completions(output, texts, scored, logprobs=logprobs)
            filtered = not validating and (
                p.dynamic_sampling_enabled
                and len(set(filter_values(completions, p.filter_reward_metric))) == 1
            )
            self._send(
                w.msg_id, w.prompt, list(output.prompt_token_ids), completions, filtered=filtered
            )

    def _send(
        self,
        msg_id: str,
        prompt: Prompt,
        ids: list[int],
        completions: list[Completion],
        *,
        filtered: bool,
        error: str | None = None,
    ) -> None:
        hand_in(
            self.session,
            msg_id,
            prompt,
            ids,
            completions,
            version=self.version,
            filtered=filtered,
            error=error,
        )


def run_colocated(session: ReplicaSession, *, device: torch.device) -> None:
    """Body of a colocated replica process (one of its ranks)."""
    ColocatedWorker(session, device=device).run()
