"""Rollout replica: prompts in, scored groups of completions out, new weights adopted mid-flight.

Three things run at once in a rollout process:

- the engine's step loop (a thread inside :class:`~nebula_rl.rollout.engine.Engine`), which batches
  every request it holds into one forward pass per token;
- a weight thread that follows the weight group's generations (it joins the group again when
  replicas come or go) and hands each push of the policy to `engine.update_weights`, which
  applies it at the next token boundary (requests in flight continue with the new weights and
  record where their version changed);
- this module's loop: claim prompts from the job's `prompts` stream, submit each as one request of
  `n_generation` samples (once the engine holds the prompt's `min_version`), score finished
  requests in a process pool, and push each group before acknowledging its prompt.

A group is pushed before its prompt is acknowledged, so a crash in between can only duplicate a
group (the controller keeps the first), never lose a prompt. Dynamic sampling (DAPO) marks groups
whose rewards are all equal as `filtered`; the controller records them and releases another prompt
in their place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from datetime import timedelta
from typing import Any, Literal

import torch

from nebula_rl.config import Config
from nebula_rl.controller.client import ReplicaSession
from nebula_rl.data import prompt_token_ids
from nebula_rl.models import load_model, load_tokenizer, resolve_dtype
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.rewards import combine_rewards, overlong_penalty
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import Engine, GenerationRequest, RequestOutput, SamplingParams
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.weights import WeightReceiver
from nebula_rl.weights.elastic import ElasticReceiver

__all__ = ["RolloutWorker", "run_rollout", "sampling_params", "score_texts"]

log = logging.getLogger(__name__)

_reward_fn: Any = None


def _init_scorer(reward_spec: Any) -> None:
    global _reward_fn
    _reward_fn = combine_rewards(reward_spec)


def score_texts(
    texts: list[str], lengths: list[int], reference: str, settings: dict[str, Any]
) -> list[float]:
    """Rewards of one group's completions (run in a reward process, or inline)."""
    if _reward_fn is None:
        _init_scorer(settings["reward_function"])
    rewards = []
    for text, length in zip(texts, lengths, strict=True):
        reward = float(_reward_fn(text, reference))
        if settings["overlong"] is not None:
            reward += overlong_penalty(length, **settings["overlong"])
        rewards.append(reward)
    return rewards


class _InlineExecutor(Executor):
    """Scores in the calling thread (`rollout.reward_workers = 0`)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:
            future.set_exception(err)
        return future


def sampling_params(cfg: Config, eos_token_id: int | None) -> SamplingParams:
    """The engine's sampling parameters for `[rollout]` (the sampling config, max tokens, EOS)."""
    s = cfg.rollout.sampling_config
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=max(s.top_k, 0),
        max_tokens=cfg.rollout.max_response_length,
        stop_token_ids=() if eos_token_id is None else (eos_token_id,),
    )


class RolloutWorker:
    """One rollout replica's generation loop (see the module docstring)."""

    def __init__(self, session: ReplicaSession, *, device: torch.device) -> None:
        self.session = session
        cfg = self.cfg = session.cfg
        p = cfg.grpo
        path = cfg.policy.model_name_or_path
        revision = cfg.policy.model_revision
        self.tokenizer = load_tokenizer(path, revision=revision)
        dtype = resolve_dtype(cfg.train.param_dtype)
        model = load_model(
            path, dtype=dtype, device=device, seed=cfg.train.seed or 0, revision=revision
        )
        if cfg.rollout.backend != "torch":
            raise ValueError(
                f"rollout.backend = {cfg.rollout.backend!r} is not wired into the runtime's "
                'rollout replicas yet; use "torch"'
            )
        self.engine: Engine = build_engine(
            cfg, model=model, tokenizer=self.tokenizer, seed=self._seed()
        )
        self.sampling = sampling_params(cfg, self.tokenizer.eos_token_id)
        overlong = p.overlong_reward
        self.score_settings = {
            "reward_function": p.reward_function,
            "overlong": (
                {
                    "max_response_length": cfg.rollout.max_response_length,
                    "buffer_length": overlong.buffer_length,
                    "penalty_factor": overlong.penalty_factor,
                }
                if overlong.enable_overlong_penalty
                else None
            ),
        }
        self.scorer: Executor = (
            ProcessPoolExecutor(
                cfg.rollout.reward_workers,
                mp_context=torch.multiprocessing.get_context("spawn"),
                initializer=_init_scorer,
                initargs=(p.reward_function,),
            )
            if cfg.rollout.reward_workers > 0
            else _InlineExecutor()
        )
        self.capacity = max(1, cfg.rollout.max_num_seqs // cfg.rollout.n_generation)
        self.num_tokens = 0
        self.num_groups = 0
        self.start_time = time.monotonic()
        self._weight_error: BaseException | None = None
        self._closing = False
        session.policy_version = lambda: self.engine.policy_version
        session.stats = self.stats

    def _seed(self) -> int:
        """Sampling seed: `rollout.seed` (else `train.seed`), distinct per replica."""
        base = self.cfg.rollout.seed if self.cfg.rollout.seed is not None else self.cfg.train.seed
        return (base or 0) + 1000 * self.session.registration["replica_id"]

    def stats(self) -> dict[str, float]:
        """Heartbeat numbers."""
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        return {
            "tokens_per_s": self.num_tokens / elapsed,
            "groups": float(self.num_groups),
        }

    # -- weights --------------------------------------------------------------------------------

    def start_weight_thread(self) -> None:
        """Follow the weight group's generations and apply every push the policy makes, in a
        daemon thread (:class:`~nebula_rl.weights.elastic.ElasticReceiver`: a push that fails
        makes the group be rebuilt, not the replica fail)."""
        backend: Literal["gloo", "nccl"] = "nccl" if self.engine_device.type == "cuda" else "gloo"
        params = list(self._model.named_parameters())
        transfer = self.cfg.train.transfer_dtype
        transfer_dtype = resolve_dtype(transfer) if transfer else None

        def apply(version: int, tensors: dict[str, torch.Tensor]) -> None:
            self.engine.update_weights(tensors, policy_version=version)
            log.info("weights of version %d in place", version)

        receiver = ElasticReceiver(
            self.session.state,
            self.session.name,
            make_receiver=lambda group: WeightReceiver(
                group, params, transfer_dtype=transfer_dtype
            ),
            apply=apply,
            backend=backend,
            timeout=timedelta(seconds=self.cfg.controller.collective_timeout),
        )

        def receive_forever() -> None:
            try:
                receiver.run(stopped=lambda: self._closing or self.session.finished() is not None)
            except BaseException as err:  # supervised: the main loop re-raises it
                self._weight_error = err

        threading.Thread(target=receive_forever, name="nebula-weights", daemon=True).start()

    @property
    def _model(self) -> torch.nn.Module:
        assert isinstance(self.engine, TorchEngine)
        return self.engine.model

    @property
    def engine_device(self) -> torch.device:
        """Where the engine's weights live."""
        return next(self._model.parameters()).device

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Generate until the controller ends the job."""
        state, name, n = self.session.state, self.session.name, self.cfg.rollout.n_generation
        # Without collect_rollout_logprobs the trainer recomputes them: the group carries none.
        collect_logprobs = self.cfg.grpo.collect_rollout_logprobs
        waiting: deque[tuple[str, Prompt]] = deque()
        generating: dict[Future[RequestOutput], tuple[str, Prompt, list[int]]] = {}
        scoring: dict[Future[list[float]], tuple[str, Prompt, list[int], RequestOutput]] = {}
        self.engine.start()
        while self.session.finished() is None:
            if self._weight_error is not None:
                raise RuntimeError("the weight thread failed") from self._weight_error
            room = min(self.capacity - len(waiting) - len(generating), self.cfg.rollout.batch_size)
            if room > 0:
                idle = not (generating or scoring or waiting)
                waiting.extend(state.claim_prompts(name, room, block_ms=200 if idle else 0))
            version = self.engine.policy_version
            while waiting and waiting[0][1].min_version <= version:
                msg_id, prompt = waiting.popleft()
                ids = prompt_token_ids(
                    self.tokenizer, prompt.prompt, system_prompt=self.cfg.grpo.system_prompt
                )
                request = GenerationRequest(ids, n=n, sampling=self.sampling)
                try:
                    generating[self.engine.submit(request)] = (msg_id, prompt, ids)
                except ValueError as err:  # e.g. a prompt longer than the model allows
                    log.error("prompt %s cannot be generated: %s", prompt.prompt_id, err)
                    self._push(msg_id, prompt, ids, [], filtered=True, error=str(err))
            pending: list[Future[Any]] = [*generating, *scoring]
            if not pending:
                time.sleep(0.01)
                continue
            done, _ = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
            for future in done:
                if future in generating:
                    msg_id, prompt, ids = generating.pop(future)  # type: ignore[call-overload]
                    output = future.result()
                    texts = [self._decode(c.token_ids) for c in output.completions]
                    lengths = [len(c.token_ids) for c in output.completions]
                    scored = self.scorer.submit(
                        score_texts, texts, lengths, prompt.reference, self.score_settings
                    )
                    scoring[scored] = (msg_id, prompt, ids, output)
                else:
                    msg_id, prompt, ids, output = scoring.pop(future)  # type: ignore[call-overload]
                    completions = [
                        Completion(
                            token_ids=list(c.token_ids),
                            logprobs=list(c.logprobs) if collect_logprobs else [],
                            text=self._decode(c.token_ids),
                            finish_reason=c.finish_reason,
                            version_changes=[(i, v) for i, v in c.version_changes],
                            reward=r,
                        )
                        for c, r in zip(output.completions, future.result(), strict=True)
                    ]
                    self.num_tokens += sum(len(c.token_ids) for c in completions)
                    rewards = [c.reward for c in completions]
                    filtered = self.cfg.grpo.dynamic_sampling_enabled and len(set(rewards)) == 1
                    self._push(msg_id, prompt, ids, completions, filtered=filtered)

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _push(
        self,
        msg_id: str,
        prompt: Prompt,
        ids: list[int],
        completions: list[Completion],
        *,
        filtered: bool,
        error: str | None = None,
    ) -> None:
        if not completions:  # the stream only takes groups with completions
            completions = [Completion([], [], "", "abort", [(0, self.engine.policy_version)])]
        extra: dict[str, Any] = {"filtered": True} if filtered else {}
        if error is not None:
            extra["error"] = error
        group = RolloutGroup(prompt, ids, completions, replica=self.session.name, extra=extra)
        self.session.state.push_group(group)
        self.session.state.ack_prompts([msg_id])
        self.num_groups += 1

    def close(self) -> None:
        """Stop the weight thread, the engine loop and the reward processes."""
        self._closing = True
        self.engine.shutdown()
        self.scorer.shutdown(wait=False, cancel_futures=True)


def run_rollout(session: ReplicaSession, *, device: torch.device) -> None:
    """Body of a rollout replica process."""
    worker = RolloutWorker(session, device=device)
    worker.start_weight_thread()
    session.start_heartbeats()
    session.mark_ready()  # the controller adds it to the weight group now
    try:
        worker.run()
    finally:
        worker.close()
