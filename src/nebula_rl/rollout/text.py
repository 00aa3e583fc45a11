"""A language or vision-language model's rollout generation: prompts in, scored groups of
completions out, new weights adopted mid-flight (:class:`TextGenerator`, which the rollout
worker of `rollout.worker` drives).

Three things run at once in a rollout process:

- the engine's step loop (a thread inside :class:`~nebula_rl.rollout.engine.Engine`), which batches
  every request it holds into one forward pass per token;
- a weight thread that follows the weight group's generations (it joins the group again when
  replicas come or go) and hands each push of the policy to `engine.update_weights`, which
  applies it at the next token boundary (requests in flight continue with the new weights and
  record where their version changed); a LoRA policy's adapter is merged into the weights
  there, in the same pause (:class:`~nebula_rl.rollout.lora_merge.LoraMerge`);
- the worker's loop (`rollout.worker.RolloutWorker.step`) claims prompts from the job's streams
  (validation prompts first); here each is submitted as one request of `n_generation` samples
  (once the engine holds the prompt's `min_version`), each finished completion decoded once,
  the group scored in a process pool (with `use_remote_reward`, in a thread that waits for the
  reward service: :class:`~nebula_rl.rewards.RemoteScorer`) and pushed before its prompt is
  acknowledged. Scoring never holds up the engine: the loop goes on claiming, submitting and
  collecting generations while scores are pending.

A group is pushed before its prompt is acknowledged, so a crash in between can only duplicate a
group (the controller keeps the first), never lose a prompt. Dynamic sampling (DAPO) marks groups
whose rewards (or `filter_reward_metric` values) are all equal as `filtered`; the controller
records them and releases another prompt in their place.

What the config decides here: the engine holds at most `max_num_seqs // n_generation` prompts,
and with `rollout.prefetch_rollout` the replica claims up to `prefetch_queue_maxsize` batches of
`batch_size` more, so the engine never waits for Redis; with `train.local_dataset` prompts come
as indices and the replica reads each row from its own copy of the dataset;
`rollout.include_stop_str_in_output` keeps the stop token's text in the text rewards see;
`train_policy.collect_rollout_logprobs = false` sends no log-probs; the scoring keys are read by
:func:`~nebula_rl.rewards.scorer`. Validation prompts (`Prompt.validation_step`) are sampled with
`[validation]`'s settings and scored with its rewards, never filtered.

A replica of `rollout.parallelism.tp_size` ranks runs the tensor-parallel engine in lock step
(:class:`~nebula_rl.rollout.lockstep.LockstepEngine`): rank 0 is the worker above; the other
ranks only replay its engine's steps (:func:`run_rollout`) and take each weight push with it, each
rank receiving its own slices straight from the policy ranks that hold them. A push that fails
part-way leaves the engine generating nothing until the next push completes (the first push of a
rebuilt weight group carries every tensor).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass
from typing import Any

import torch

from nebula_rl.config import Config, PolicyConfig, RolloutConfig
from nebula_rl.controller.client import ReplicaSession
from nebula_rl.data import prompt_token_ids, rl_rows, rl_validation_rows
from nebula_rl.data.vision import VisionInputs, VisionProcessor, vision_processor
from nebula_rl.models import load_model, load_tokenizer, resolve_dtype
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.rewards import RemoteScorer, Scored, Scorer, filter_values, scorer
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import Engine, GenerationRequest, RequestOutput, SamplingParams
from nebula_rl.rollout.lockstep import LockstepEngine
from nebula_rl.rollout.lora_merge import LoraMerge
from nebula_rl.rollout.multiturn import Conversation, MultiTurn, loss_mask, with_turn_rewards
from nebula_rl.rollout.tensor_parallel import TensorParallel
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.rollout.vllm_engine import VLLMEngine
from nebula_rl.rollout.worker import Claimed, RolloutWorker, serve, weight_receiver
from nebula_rl.utils.ranks import Ranks, broadcast_object, rank_env
from nebula_rl.utils.validation import validation_seed
from nebula_rl.weights.elastic import ElasticReceiver

__all__ = [
    "InlineExecutor",
    "TextGenerator",
    "close_scorers",
    "completion_text",
    "completion_texts",
    "hand_in",
    "make_completions",
    "multi_turn",
    "prompt_inputs",
    "run_rollout",
    "sampling_params",
    "submit_scoring",
    "validation_sampling_params",
]

log = logging.getLogger(__name__)


class InlineExecutor(Executor):
    """Scores in the calling thread (`rollout.reward_workers = 0`)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:
            future.set_exception(err)
        return future


def prompt_inputs(
    tokenizer: Any,
    vision: VisionProcessor | None,
    prompt: str | list[dict[str, Any]],
    *,
    system_prompt: str = "",
) -> tuple[list[int], VisionInputs | None]:
    """A prompt's token ids for generation and, for a vision-language model (`vision`, its
    processor), its images and videos (None for a prompt without)."""
    if vision is None:
        return prompt_token_ids(tokenizer, prompt, system_prompt=system_prompt), None
    inputs = vision.prompt(prompt, system_prompt=system_prompt)
    return inputs.input_ids, inputs if inputs.has_media else None


def sampling_params(rollout: RolloutConfig, eos_token_id: int | None) -> SamplingParams:
    """The engine's sampling parameters for `[rollout]` (the sampling config, max tokens, EOS)."""
    s = rollout.sampling_config
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=max(s.top_k, 0),
        repetition_penalty=s.repetition_penalty,
        max_tokens=rollout.max_response_length,
        stop_token_ids=() if eos_token_id is None else (eos_token_id,),
    )


def validation_sampling_params(
    cfg: Config, eos_token_id: int | None, *, seed: int | None = None
) -> SamplingParams:
    """The sampling parameters of validation (`[validation]`; top_p None takes the rollout's,
    top_k None or -1 keeps every token, max_response_length None takes the rollout's)."""
    v = cfg.validation
    top_p = v.top_p if v.top_p is not None else cfg.rollout.sampling_config.top_p
    return SamplingParams(
        temperature=v.temperature,
        top_p=top_p,
        top_k=max(v.top_k, 0) if v.top_k is not None else 0,
        repetition_penalty=v.repetition_penalty,
        max_tokens=v.max_response_length or cfg.rollout.max_response_length,
        stop_token_ids=() if eos_token_id is None else (eos_token_id,),
        seed=seed,
    )


def completion_text(
    tokenizer: Any, token_ids: Sequence[int], finish_reason: str, *, include_stop: bool
) -> str:
    """The text of a completion, as rewards see and the group stores it (decoded once).

    A completion that stopped (`finish_reason == "stop"`) ends with its stop token; its text is
    left out unless `include_stop` (`rollout.include_stop_str_in_output`). The token ids, which
    training uses, keep the stop token either way."""
    ids = list(token_ids)
    stop = ids.pop() if finish_reason == "stop" and ids else None
    text = str(tokenizer.decode(ids, skip_special_tokens=True))
    if include_stop and stop is not None:
        text += str(tokenizer.decode([stop], skip_special_tokens=False))
    return text


def make_completions(
    output: RequestOutput, texts: Sequence[str], scored: Sequence[Scored], *, logprobs: bool
) -> list[Completion]:
    """The wire completions of a finished request: tokens, texts, scores, and the log-probs when
    `logprobs` (`train_policy.collect_rollout_logprobs`; else empty)."""
    return [
        Completion(
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs) if logprobs else [],
            text=text,
            finish_reason=c.finish_reason,
            version_changes=[(i, v) for i, v in c.version_changes],
            reward=s.reward,
            reward_terms=s.terms,
            loss_mask=loss_mask(c),
        )
        for c, text, s in zip(output.completions, texts, scored, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class _Claimed(Claimed):
    """A claimed prompt with its text and reference."""

    text: str | list[dict[str, Any]]
    reference: str
    inputs: Future[tuple[list[int], VisionInputs | None]] | None = None
    """Its token ids and media, prepared in a loader thread (`dataloader_num_workers`)."""


class TextGenerator:
    """A language or vision-language model's rollout generation (see the module docstring):
    the rollout worker's :class:`~nebula_rl.rollout.worker.Generator`."""

    def __init__(
        self,
        session: ReplicaSession,
        *,
        device: torch.device,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        self.session = session
        self.cfg = cfg = session.cfg
        self.tokenizer, self.engine = _engine(session, device, tensor_parallel)
        config: Any = self._model.config
        self.vision = vision_processor(cfg.policy, config)
        self.sampling = sampling_params(cfg.rollout, self.tokenizer.eos_token_id)
        self.multi_turn = multi_turn(cfg, self.tokenizer, self.vision)
        self.conversations: dict[str, list[Conversation]] = {}
        """Multi-turn: each request's conversations, until its group is pushed."""
        validating = cfg.validation.enable
        # With local_dataset prompts arrive as indices: this replica reads its own rows.
        local = cfg.train.local_dataset
        self.rows = rl_rows(cfg) if local else None
        self.val_rows = rl_validation_rows(cfg) if local and validating else None
        self.pool: Executor = (
            ProcessPoolExecutor(
                cfg.rollout.reward_workers, mp_context=torch.multiprocessing.get_context("spawn")
            )
            if cfg.rollout.reward_workers > 0
            else InlineExecutor()
        )
        r = cfg.rollout
        self.capacity = max(1, r.max_num_seqs // r.n_generation)
        """Prompts the engine has room for."""
        p = cfg.grpo
        self.loader = (
            ThreadPoolExecutor(p.dataloader_num_workers, thread_name_prefix="nebula-loader")
            if p.dataloader_num_workers > 0
            else None
        )
        """Threads preparing claimed prompts (`dataloader_num_workers`)."""
        self.claim_limit = (
            self.capacity
            + (r.prefetch_queue_maxsize * r.batch_size if r.prefetch_rollout else 0)
            + p.dataloader_num_workers * (p.dataloader_prefetch_factor or 2)
        )
        """Prompts held at most (in the engine or waiting for it)."""
        self.scorer = scorer(cfg, max_groups=self.claim_limit)
        self.val_scorer = (
            scorer(cfg, validation=True, max_groups=self.claim_limit) if validating else None
        )
        self.generating: dict[Future[RequestOutput], _Claimed] = {}
        self.scoring: dict[Future[list[Scored]], tuple[_Claimed, RequestOutput, list[str]]] = {}
        self.num_tokens = 0
        self.start_time = time.monotonic()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def stats(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        return {"tokens_per_s": self.num_tokens / elapsed}

    # -- weights --------------------------------------------------------------------------------

    def receiver(self, session: ReplicaSession) -> ElasticReceiver:
        """Each push goes to `engine.update_weights_with`, applied at the next token boundary
        (requests in flight continue with the new weights); a LoRA policy's adapter is merged
        in the same pause."""
        engine = self.engine
        assert isinstance(engine, TorchEngine | VLLMEngine)

        size = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        device = next(engine.model.parameters()).device
        lora = _lora_merge(self.cfg.policy, engine)

        def apply(receive: Callable[[], int | None]) -> None:
            took: list[float] = []

            def timed() -> int | None:
                start = time.perf_counter()
                try:
                    return receive() if lora is None else lora.after(receive())
                finally:
                    took.append(time.perf_counter() - start)

            if isinstance(engine, LockstepEngine):  # (the other ranks take the same push)
                assert receiver.generation is not None
                engine.update_weights_with(timed, note=receiver.generation.number)
            else:
                engine.update_weights_with(timed)  # at the next token boundary
            if engine.damaged:
                log.warning("a weight push failed part-way: generating nothing until the next")
            else:
                # (the receive's own time, generation paused; the model's bytes over it)
                peak = (
                    f"; peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.2f} GB"
                    if device.type == "cuda"
                    else ""
                )
                log.info(
                    "weights of version %d in place: received in %.3f s (%.2f GB/s of the "
                    "model's %.2f GB)%s",
                    engine.policy_version,
                    took[0],
                    size / max(took[0], 1e-9) / 1e9,
                    size / 1e9,
                    peak,
                )

        receiver = _receiver(session, engine, lora, apply=apply)
        return receiver

    @property
    def _model(self) -> torch.nn.Module:
        """The engine's model (vLLM's: the staging copy that weight pushes write into)."""
        assert isinstance(self.engine, TorchEngine | VLLMEngine)
        return self.engine.model

    # -- prompts --------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine.start()

    def prepare(self, msg_id: str, prompt: Prompt) -> _Claimed:
        """The prompt with its text and reference: as sent, or from this replica's own rows;
        its tokens prepared in a loader thread (`dataloader_num_workers`)."""
        p = self.cfg.grpo
        if prompt.prompt is not None and prompt.reference is not None:
            text, reference = prompt.prompt, prompt.reference
        else:
            rows = self.rows if prompt.validation_step is None else self.val_rows
            assert rows is not None, f"prompt {prompt.prompt_id} comes without its text"
            row = rows[prompt.index]
            text, reference = row[p.prompt_column_name], str(row[p.response_column_name])
        inputs = None
        if self.loader is not None:
            inputs = self.loader.submit(
                prompt_inputs, self.tokenizer, self.vision, text, system_prompt=p.system_prompt
            )
        return _Claimed(msg_id, prompt, text, reference, inputs)

    def in_flight(self) -> int:
        return len(self.generating)

    def busy(self) -> bool:
        return bool(self.generating or self.scoring)

    def submit(self, claimed: Sequence[Claimed]) -> int:
        """Submit each prompt as one request of `n_generation` samples (the engine queues what
        it has no room for yet)."""
        pushed = 0
        for c in claimed:
            assert isinstance(c, _Claimed)  # (made by `prepare`)
            pushed += self._submit(c)
        return pushed

    def _submit(self, claimed: _Claimed) -> int:
        prompt = claimed.prompt
        ids: list[int] = []
        try:
            if prompt.validation_step is None:
                n, sampling = self.cfg.rollout.n_generation, self.sampling
            else:
                seed = validation_seed(self.cfg, prompt.validation_step, prompt.index)
                n = self.cfg.validation.n_generation
                sampling = validation_sampling_params(
                    self.cfg, self.tokenizer.eos_token_id, seed=seed
                )
            if self.multi_turn is not None:
                request, conversations = self.multi_turn.request(
                    claimed.text, claimed.reference, n=n, sampling=sampling
                )
                ids = list(request.prompt_token_ids)
            else:
                conversations = None
                ids, media = (
                    claimed.inputs.result()
                    if claimed.inputs is not None
                    else prompt_inputs(
                        self.tokenizer,
                        self.vision,
                        claimed.text,
                        system_prompt=self.cfg.grpo.system_prompt,
                    )
                )
                request = GenerationRequest(ids, n=n, sampling=sampling, media=media)
            future = self.engine.submit(request)
            if conversations is not None:
                self.conversations[request.request_id] = conversations
            self.generating[future] = claimed
            return 0
        except ValueError as err:  # e.g. a prompt longer than the model allows, a bad image
            log.error("prompt %s cannot be generated: %s", prompt.prompt_id, err)
            self._push(claimed, ids, [], filtered=True, error=str(err))
            return 1

    def collect(self, timeout_s: float) -> int:
        """Decode finished generations and send them to be scored; push scored groups."""
        pending: list[Future[Any]] = [*self.generating, *self.scoring]
        done, _ = wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
        pushed = 0
        for future in done:
            if future in self.generating:
                self._generated(self.generating.pop(future), future.result())
            else:
                claimed, output, texts = self.scoring.pop(future)
                self._scored(claimed, output, texts, future.result())
                pushed += 1
        return pushed

    def _generated(self, claimed: _Claimed, output: RequestOutput) -> None:
        """Decode each completion once and send the group to be scored."""
        texts = completion_texts(
            self.cfg.rollout, self.tokenizer, output, self.conversations.get(output.request_id)
        )
        lengths = [len(c.token_ids) for c in output.completions]
        validating = claimed.prompt.validation_step is not None
        score = self.val_scorer if validating else self.scorer
        assert score is not None
        future = submit_scoring(
            score, self.pool, texts, lengths, claimed.reference, group=claimed.prompt.prompt_id
        )
        self.scoring[future] = (claimed, output, texts)

    def _scored(
        self, claimed: _Claimed, output: RequestOutput, texts: list[str], scored: list[Scored]
    ) -> None:
        validating = claimed.prompt.validation_step is not None
        logprobs = self.cfg.grpo.collect_rollout_logprobs and not validating
        conversations = self.conversations.pop(output.request_id, None)
        if conversations is not None:
            scored = with_turn_rewards(scored, [c.rewards for c in conversations])
        completions = make_completions(output, texts, scored, logprobs=logprobs)
        p = self.cfg.grpo
        filtered = False
        if not validating:
            self.num_tokens += sum(len(c.token_ids) for c in completions)
            values = filter_values(completions, p.filter_reward_metric)
            filtered = p.dynamic_sampling_enabled and len(set(values)) == 1
        self._push(claimed, list(output.prompt_token_ids), completions, filtered=filtered)

    def _push(
        self,
        claimed: _Claimed,
        ids: list[int],
        completions: list[Completion],
        *,
        filtered: bool,
        error: str | None = None,
    ) -> None:
        hand_in(
            self.session,
            claimed.msg_id,
            claimed.prompt,
            ids,
            completions,
            version=self.engine.policy_version,
            filtered=filtered,
            error=error,
        )

    def close(self, *, job_ended: bool) -> None:
        """Stop the engine loop (and the other ranks') and the reward processes."""
        self.engine.shutdown()
        if self.loader is not None:
            self.loader.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.engine, LockstepEngine):
            self.engine.stop_followers()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.multi_turn is not None:
            self.multi_turn.executor.shutdown(wait=False, cancel_futures=True)
        close_scorers(self.scorer, self.val_scorer)


def multi_turn(cfg: Config, tokenizer: Any, vision: VisionProcessor | None) -> MultiTurn | None:
    """The multi-turn request builder (`rollout.multi_turn_config.enable`), its environments'
    steps run in a thread pool; None for single-turn rollouts."""
    if not cfg.rollout.multi_turn_config.enable:
        return None
    if vision is not None:
        raise ValueError(
            "rollout.multi_turn_config.enable is not supported yet for vision-language models"
        )
    executor = ThreadPoolExecutor(
        min(32, cfg.rollout.max_num_seqs), thread_name_prefix="nebula-env"
    )
    return MultiTurn(cfg, tokenizer, executor)


def completion_texts(
    rollout: RolloutConfig,
    tokenizer: Any,
    output: RequestOutput,
    conversations: Sequence[Conversation] | None,
) -> list[str]:
    """The texts the reward functions score: each completion's (decoded once), or of a
    multi-turn conversation its last assistant turn."""
    if conversations is not None:
        return [
            conversation.final_text(c)
            for conversation, c in zip(conversations, output.completions, strict=True)
        ]
    include_stop = rollout.include_stop_str_in_output
    return [
        completion_text(tokenizer, c.token_ids, c.finish_reason, include_stop=include_stop)
        for c in output.completions
    ]


def _engine(
    session: ReplicaSession, device: torch.device, tensor_parallel: TensorParallel | None
) -> tuple[Any, Engine]:
    """The tokenizer and the engine of a rollout rank: the policy's starting weights, sampling
    seeded by `rollout.seed` (else `train.seed`), distinct per replica, alike on its ranks."""
    cfg = session.cfg
    path, revision = cfg.policy.model_name_or_path, cfg.policy.model_revision
    tokenizer = load_tokenizer(path, revision=revision)
    dtype = resolve_dtype(cfg.train.param_dtype)
    model = load_model(
        path, dtype=dtype, device=device, seed=cfg.train.seed or 0, revision=revision
    )
    base = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.train.seed
    seed = (base or 0) + 1000 * session.registration["replica_id"]
    engine = build_engine(
        cfg, model=model, tokenizer=tokenizer, seed=seed, tensor_parallel=tensor_parallel
    )
    return tokenizer, engine


def _lora_merge(policy: PolicyConfig, engine: TorchEngine | VLLMEngine) -> LoraMerge | None:
    """The adapter buffers and merge of a LoRA policy's pushes (None without `policy.lora`)."""
    if policy.lora is None:
        return None
    return LoraMerge(engine.model, engine.tp_boxes(), policy.lora)


def _receiver(
    session: ReplicaSession,
    engine: TorchEngine | VLLMEngine,
    lora: LoraMerge | None,
    *,
    apply: Callable[[Callable[[], int | None]], None] | None = None,
    local_rank: int = 0,
) -> ElasticReceiver:
    """This rank's member of the weight group: the policy's slices go straight into the
    engine's parameters (its TP shards; on one host, CPU parameters become views of the
    shared-memory set the policy wrote: no copy on this side; GPU parameters sharing the
    policy's GPU, `mode = "colocated_separated"`, take copies from it), or with `lora` into its
    adapter buffers and the parameters it does not adapt (the caller merges after each
    receive). Without `apply` (ranks > 0 of a TP replica) it only joins and leaves
    generations; the pushes are taken with `receive_for`."""
    params = dict(engine.model.named_parameters()) if lora is None else lora.tensors
    boxes = engine.tp_boxes() if lora is None else lora.boxes
    device = next(engine.model.parameters()).device
    return weight_receiver(
        session, params, boxes, device=device, apply=apply, zero_copy=True, local_rank=local_rank
    )


def submit_scoring(
    score: Scorer | RemoteScorer,
    pool: Executor,
    texts: list[str],
    lengths: list[int],
    reference: str,
    *,
    group: str,
) -> Future[list[Scored]]:
    """Score one group (`group` names it in log lines) without waiting: rule rewards in `pool`
    (reward processes, or inline), remote rewards in the scorer's own threads (a
    :class:`~nebula_rl.rewards.RemoteScorer` waits for the service and cannot go to a process)."""
    if isinstance(score, RemoteScorer):
        return score.submit(texts, lengths, reference, group=group)
    return pool.submit(score.score_group, texts, lengths, reference)


def close_scorers(*scorers: Scorer | RemoteScorer | None) -> None:
    """Stop the remote scorers among `scorers` (their threads and HTTP connections)."""
    for score in scorers:
        if isinstance(score, RemoteScorer):
            score.close()


def hand_in(
    session: ReplicaSession,
    msg_id: str,
    prompt: Prompt,
    ids: list[int],
    completions: list[Completion],
    *,
    version: int,
    filtered: bool,
    error: str | None = None,
) -> None:
    """Push a prompt's group (to a teacher first: a training group of a distillation job) and
    acknowledge the prompt; what a rollout replica and a colocated policy replica do with each
    group they generated. `version`: the weights' version, for a group without completions."""
    if not completions:  # the stream only takes groups with completions
        completions = [Completion([], [], "", "abort", [(0, version)])]
    extra: dict[str, Any] = {"filtered": True} if filtered else {}
    if error is not None:
        extra["error"] = error
    group = RolloutGroup(prompt, ids, completions, replica=session.name, extra=extra)
    state = session.state
    training = prompt.validation_step is None and not extra
    if training and session.cfg.distillation.enable:  # a teacher scores it first
        state.push_for_teacher(group)
    else:
        state.push_group(group)
    if prompt.validation_step is None:
        state.ack_prompts([msg_id])
    else:
        state.ack_validation([msg_id])


def run_rollout(session: ReplicaSession, *, device: torch.device) -> None:
    """Body of a rollout replica's processes (rank 0: the worker; the others follow it)."""
    ranks = rank_env()
    tensor_parallel = TensorParallel.of() if ranks.world_size > 1 else None
    if ranks.rank > 0:
        _follow(session, device, tensor_parallel, ranks)
        return
    generator = TextGenerator(session, device=device, tensor_parallel=tensor_parallel)
    worker = RolloutWorker(session, generator)
    # (with tensor parallelism: ready once every rank holds its shards)
    serve(worker, loaded=(lambda: broadcast_object("loaded")) if ranks.world_size > 1 else None)


def _follow(
    session: ReplicaSession,
    device: torch.device,
    tensor_parallel: TensorParallel | None,
    ranks: Ranks,
) -> None:
    """Ranks > 0 of a TP replica: replay rank 0's engine, taking the same weight pushes."""
    _, engine = _engine(session, device, tensor_parallel)
    assert isinstance(engine, LockstepEngine)
    lora = _lora_merge(session.cfg.policy, engine)
    receiver = _receiver(session, engine, lora, local_rank=ranks.local_rank)
    done = threading.Event()
    errors: list[BaseException] = []

    def follow_generations() -> None:
        try:
            receiver.run(stopped=done.is_set)
        except BaseException as err:  # supervised: reported below
            errors.append(err)

    thread = threading.Thread(target=follow_generations, name="nebula-weights", daemon=True)
    thread.start()
    broadcast_object(None)  # loaded
    timeout_s = session.cfg.controller.collective_timeout

    def receive(generation: int) -> int | None:
        version = receiver.receive_for(generation, timeout_s=timeout_s)
        return version if lora is None else lora.after(version)

    try:
        engine.follow(receive)
    finally:
        done.set()
    thread.join(timeout=timeout_s)
    if errors:
        raise RuntimeError("the weight thread failed") from errors[0]
