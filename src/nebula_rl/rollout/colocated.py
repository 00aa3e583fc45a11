"""A colocated policy replica's text generation (`mode = "colocated"`, language and
vision-language models): each rank decodes its share of a round's prompts with the built-in
engine on its own copy of the weights; rank 0 claims the prompts, scores the groups and pushes
them as a rollout replica does (`policy.colocated` runs the rounds)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.data import rl_rows, rl_validation_rows
from nebula_rl.data.vision import VisionProcessor
from nebula_rl.models import load_model, resolve_dtype
from nebula_rl.protocol import Prompt
from nebula_rl.rewards import Scored, filter_values, scorer
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import GenerationRequest, RequestOutput
from nebula_rl.rollout.multiturn import with_turn_rewards
from nebula_rl.rollout.text import (
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

__all__ = ["TextRounds"]

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


class TextRounds:
    """One rank's generation in a colocated language-model replica (the `policy.colocated.Rounds`
    of text and vision-language models).

    Why the engine decodes its own copy of the weights rather than the training module: the
    training module is in `train.master_dtype`, possibly FSDP2-sharded, checkpointed and
    compiled, while the engine decodes in `train.param_dtype` and fuses q/k/v and gate/up into
    one matmul by re-pointing its parameters at a fused buffer, which the optimiser's parameters
    cannot be. The copy costs the model once in `param_dtype` per rank (no optimiser state, no
    gradients) and one in-place copy per step; generation is a plain, synchronous
    `engine.generate` on each rank, so the ranks need no lock step, and replica 1's rank 0
    samples exactly as `nebula-rl train --local` does (same seed, same batches)."""

    def __init__(
        self,
        session: ReplicaSession,
        device: torch.device,
        *,
        rank: int,
        tokenizer: Any,
        vision: VisionProcessor | None,
    ) -> None:
        self.session = session
        cfg = self.cfg = session.cfg
        self.tokenizer, self.vision = tokenizer, vision
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
            cfg, model=model, tokenizer=tokenizer, seed=base + 1000 * replica + rank
        )
        self.multi_turn = multi_turn(cfg, tokenizer, vision)
        """Multi-turn conversations (`rollout.multi_turn_config`): every rank runs the
        environments of the samples it generates."""
        self.lead = rank == 0
        if self.lead:
            self.sampling = sampling_params(cfg.rollout, tokenizer.eos_token_id)
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

    def load(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, *, first: bool
    ) -> None:
        self.engine.update_weights(weights, policy_version=version)

    def claim(self, version: int) -> list[_Work]:
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
            assert prompt.min_version <= version, (
                f"prompt {prompt.prompt_id} needs weights of version {prompt.min_version}; this "
                f"replica holds {version}"
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
                hand_in(
                    self.session, msg_id, prompt, [], [],
                    version=version, filtered=True, error=str(err),
                )  # fmt: skip
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

    def generate(self, work: list[_Work]) -> list[_Generated]:
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
                completion_texts(self.cfg.rollout, self.tokenizer, output, conversations),
                None if conversations is None else [c.rewards for c in conversations],
            )
            for output, conversations in zip(outputs, chats, strict=True)
        ]

    def push(self, work: list[_Work], generated: list[_Generated], version: int) -> None:
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
            ids = list(output.prompt_token_ids)
            hand_in(
                self.session, w.msg_id, w.prompt, ids, completions,
                version=version, filtered=filtered,
            )  # fmt: skip

    def close(self) -> None:
        if self.multi_turn is not None:
            self.multi_turn.executor.shutdown(wait=False, cancel_futures=True)
        if self.lead:
            self.pool.shutdown(wait=False, cancel_futures=True)
            close_scorers(self.scorer, self.val_scorer)
