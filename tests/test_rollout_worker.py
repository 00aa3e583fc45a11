"""The rollout replica's loop against a real controller API and Redis, without a policy: what it
claims, what it generates and how it scores, as the config says.

Each test joins one rollout replica (the real `RolloutWorker` and `TextGenerator` on the tiny
Qwen2 preset, its engine running) to a job whose prompts the test puts on the streams, and reads
the groups it pushes back. No weights travel: the engine keeps version 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from nebula_rl.config import Config
from nebula_rl.controller import JobState, connect, create_app, serve, start_redis
from nebula_rl.controller.client import TOKEN_ENV, ReplicaSession
from nebula_rl.data import prompt_token_ids, rl_prompt, rl_rows, rl_validation_rows
from nebula_rl.models import load_tokenizer
from nebula_rl.protocol import Prompt, RolloutGroup
from nebula_rl.rollout.text import TextGenerator, completion_text, sampling_params
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.rollout.worker import RolloutWorker

TOKEN = "rollout-worker-test-token-0123"
TEST_REWARDS = __name__


def reference_reward(completion: str, reference: str) -> float:
    """The reference answer as the reward: shows which reference a group was scored against."""
    return float(reference)


def length_reward(completion: str, reference: str) -> float:
    return float(len(completion))


def constant_reward(completion: str, reference: str) -> float:
    return 0.5


def custom_reward(completion: str, reference: str, custom: dict[str, Any]) -> float:
    return float(custom["bonus"])


def failing_reward(completion: str, reference: str) -> float:
    raise AssertionError("bypass_reward: no reward function may run")


Worker = Callable[..., RolloutWorker]


@pytest.fixture
def rollout_worker(tmp_path, grpo_job_config, monkeypatch) -> Iterator[Worker]:
    """`make(*changes)`: a job whose config is the arithmetic job with `changes`, and its
    rollout replica (engine started); the job's state is `worker.session.state`."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with ExitStack() as stack:
        redis = stack.enter_context(start_redis(data_dir=tmp_path / "redis"))

        def make(*changes: dict[str, Any]) -> RolloutWorker:
            cfg = grpo_job_config(*changes)
            state = JobState(connect(redis.url), "job")
            app = create_app(
                state=state,
                config_json=cfg.model_dump(mode="json"),
                token=TOKEN,
                meta_extra={"redis_url": redis.url},
            )
            server = stack.enter_context(serve(app))
            session = ReplicaSession.join(server.url, name="rollout-0", role="rollout")
            stack.callback(session.leave)
            generator = TextGenerator(session, device=torch.device("cpu"))
            worker = RolloutWorker(session, generator)
            stack.callback(worker.close)
            generator.start()
            return worker

        yield make


def _enqueue(
    cfg: Config, state: JobState, num: int, *, first: int = 0, **prompt: Any
) -> list[Prompt]:
    rows = rl_rows(cfg)
    prompts = [
        rl_prompt(cfg.grpo, rows, epoch=0, index=i, with_text=not cfg.train.local_dataset)
        for i in range(first, first + num)
    ]
    prompts = [Prompt(**{**_fields(p), **prompt}) for p in prompts]
    assert state.enqueue_prompts(prompts) == num
    return prompts


def _fields(p: Prompt) -> dict[str, Any]:
    return {name: getattr(p, name) for name in Prompt.__slots__}  # type: ignore[attr-defined]


def _groups(worker: RolloutWorker, num: int, timeout_s: float = 60.0) -> list[RolloutGroup]:
    """Run the worker's loop until it pushed `num` groups; those groups, by prompt id."""
    state = worker.session.state
    deadline = time.monotonic() + timeout_s
    while worker.num_groups < num:
        assert time.monotonic() < deadline, f"{worker.num_groups} of {num} groups"
        worker.step()
    groups = [g for _, g in state.poll_groups(100)]
    assert len(groups) == num
    return sorted(groups, key=lambda g: g.prompt.prompt_id)


@pytest.mark.parametrize("prefetch", [False, True])
def test_claims_what_the_engine_has_room_for_plus_the_prefetch(rollout_worker, prefetch):
    worker = rollout_worker(
        {
            "rollout": {
                "max_num_seqs": 12,  # room for 3 prompts of n_generation 4
                "batch_size": 2,
                "prefetch_rollout": prefetch,
                "prefetch_queue_maxsize": 3,
            }
        }
    )
    worker.generator.engine.shutdown()  # (nothing is generated: the claims are counted alone)
    _enqueue(worker.cfg, worker.session.state, 20)
    claims = []
    while claimed := worker.claim():
        claims.append(claimed)
    expected = 3 + (3 * 2 if prefetch else 0)
    assert sum(claims) == len(worker.waiting) == expected
    assert max(claims) == 2  # `batch_size` at a time
    # The engine takes what it has room for; what it took makes room for no more claims.
    worker.submit_ready()
    assert len(worker.generator.generating) == expected and worker.claim() == 0


def test_loader_threads_prepare_claimed_prompts_ahead(rollout_worker):
    """train_policy.dataloader_num_workers: claimed prompts are tokenized in loader threads, and
    the replica holds workers x prefetch_factor prompts more; the groups are those of prompts
    prepared at submission."""
    worker = rollout_worker(
        {
            "rollout": {"max_num_seqs": 12, "batch_size": 4},
            "train": {
                "train_policy": {"dataloader_num_workers": 2, "dataloader_prefetch_factor": 3}
            },
        }
    )
    assert worker.generator.loader is not None and worker.generator.claim_limit == 3 + 2 * 3
    prompts = _enqueue(worker.cfg, worker.session.state, 6)
    groups = _groups(worker, 6)
    rows, column = rl_rows(worker.cfg), worker.cfg.grpo.prompt_column_name
    for prompt, group in zip(prompts, groups, strict=True):
        text = prompt.prompt if prompt.prompt is not None else rows[prompt.index][column]
        want = prompt_token_ids(worker.generator.tokenizer, text, system_prompt="")
        assert group.prompt == prompt and group.prompt_token_ids == want


@pytest.mark.parametrize("local", [True, False])
def test_prompt_rows_come_from_the_replicas_copy_or_with_the_prompt(rollout_worker, local):
    """train.local_dataset: the prompt carries the row's index only and the replica reads its own
    copy of the row; otherwise it uses the text and reference that come with the prompt (here
    not the row's, to tell them apart)."""
    worker = rollout_worker(
        {
            "train": {
                "local_dataset": local,
                "train_policy": {"reward_function": f"{TEST_REWARDS}:reference_reward"},
            }
        }
    )
    cfg, state = worker.cfg, worker.session.state
    sent = {} if local else {"prompt": "1+1=", "reference": "-7"}
    prompts = _enqueue(cfg, state, 3, **sent)
    rows = rl_rows(cfg)
    for prompt, group in zip(prompts, _groups(worker, 3), strict=True):
        assert group.prompt == prompt and (prompt.prompt is None) == local
        expected = float(rows[prompt.index]["answer"]) if local else -7.0
        assert group.rewards == [expected] * 4
    assert state.ledger_summary(0)["outstanding"] == 3  # pushed, acknowledged, not yet judged


def test_scores_texts_logprobs_and_filters_as_configured(rollout_worker):
    """Rewards with the `custom` table, per-function reward terms, dynamic sampling by the named
    reward's values (a constant one: filtered), no log-probs without collect_rollout_logprobs;
    each text is the decoded completion without its stop token."""
    worker = rollout_worker(
        {
            "train": {
                "train_policy": {
                    "reward_function": {
                        f"{TEST_REWARDS}:custom_reward": 2.0,
                        f"{TEST_REWARDS}:length_reward": 1.0,
                    },
                    "filter_reward_metric": f"{TEST_REWARDS}:constant_reward",
                    "collect_rollout_logprobs": False,
                    "use_rollout_logprobs_for_loss": False,
                }
            },
            "custom": {"bonus": 3.0},
        }
    )
    _enqueue(worker.cfg, worker.session.state, 2)
    for group in _groups(worker, 2):
        assert group.extra == {"filtered": True}  # constant_reward never varies
        for c in group.completions:
            assert c.logprobs == [] and c.token_ids
            assert c.text == completion_text(
                worker.generator.tokenizer, c.token_ids, c.finish_reason, include_stop=False
            )
            terms = {"custom_reward": 3.0, "length_reward": float(len(c.text))}
            terms["constant_reward"] = 0.5  # a filter metric only: not in the total
            assert c.reward_terms == {f"{TEST_REWARDS}:{k}": v for k, v in terms.items()}
            assert c.reward == 2.0 * 3.0 + len(c.text)


def test_bypass_reward_runs_no_reward_function(rollout_worker):
    worker = rollout_worker(
        {"train": {"train_policy": {"reward_function": f"{TEST_REWARDS}:failing_reward"}}},
        {"train": {"train_policy": {"bypass_reward": True}}},
    )
    _enqueue(worker.cfg, worker.session.state, 2)
    for group in _groups(worker, 2):
        assert group.rewards == [0.0] * 4 and group.extra == {}
        assert all(
            c.reward_terms == {} and len(c.logprobs) == len(c.token_ids) for c in group.completions
        )


def test_validation_prompts_go_first_with_validation_sampling_and_rewards(rollout_worker):
    worker = rollout_worker(
        {
            "train": {"train_policy": {"dataset": {"test_size": 4}}},
            "validation": {
                "enable": True,
                "n_generation": 3,
                "max_response_length": 1,
                "reward_function": f"{TEST_REWARDS}:reference_reward",
            },
        }
    )
    cfg, state = worker.cfg, worker.session.state
    val_rows = rl_validation_rows(cfg)
    _enqueue(cfg, state, 2)
    prompts = [
        rl_prompt(cfg.grpo, val_rows, epoch=0, index=i, validation_step=0, with_text=False)
        for i in range(4)
    ]
    assert state.enqueue_validation(0, prompts)
    worker.claim()
    assert len(worker.val_waiting) == 4 and len(worker.waiting) == 0  # validation first
    groups = _groups(worker, 6)
    validation = [g for g in groups if g.prompt.validation_step == 0]
    assert len(validation) == 4
    for g in validation:
        # validation.n_generation, .max_response_length and .reward_function, no log-probs
        assert g.rewards == [float(val_rows[g.prompt.index]["answer"])] * 3
        assert all(len(c.token_ids) == 1 and c.logprobs == [] for c in g.completions)
        assert len({tuple(c.token_ids) for c in g.completions}) == 1  # greedy (top_k 1)
    training = [g for g in groups if g.prompt.validation_step is None]
    assert [len(g.completions) for g in training] == [4, 4]
    assert state.claim_validation("rollout-1", 10) == []  # acknowledged: none left pending


def test_stop_token_text_is_kept_only_when_asked():
    tokenizer = load_tokenizer("tiny:qwen2")
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("12", add_special_tokens=False) + [eos]
    assert completion_text(tokenizer, ids, "stop", include_stop=False) == "12"
    assert completion_text(tokenizer, ids, "stop", include_stop=True) == "12<|im_end|>"
    # A completion cut at max tokens ends with no stop token: nothing is left out.
    assert completion_text(tokenizer, ids[:-1], "length", include_stop=False) == "12"


def test_sampling_settings_follow_the_config(grpo_job_config):
    cfg = grpo_job_config({"rollout": {"sampling_config": {"repetition_penalty": 1.3}}})
    assert sampling_params(cfg.rollout, 2).repetition_penalty == 1.3


def test_multi_turn_conversations_are_pushed_with_their_mask_and_turn_rewards(rollout_worker):
    """The arithmetic environment through the replica's loop: the prompt is the environment's
    opening, each completion is turn + observation (the dataset's question, masked) + turn, and
    the warm-up turn's reward is in the total. Every token ends a turn here (the engine's stop
    ids are the whole vocabulary), so each turn is one token."""
    worker = rollout_worker(
        {
            "policy": {"model_max_length": 128},
            "rollout": {
                "max_response_length": 48,
                "multi_turn_config": {
                    "enable": True,
                    "environment": "arithmetic",
                    "max_assistant_turns": 2,
                },
            },
        }
    )
    assert isinstance(worker.generator.engine, TorchEngine)
    worker.generator.engine.eos_token_ids = tuple(range(worker.generator.engine.vocab_size))
    (prompt,) = _enqueue(worker.cfg, worker.session.state, 1)
    (group,) = _groups(worker, 1)
    question = rl_rows(worker.cfg)[prompt.index]["prompt"]
    opening = worker.generator.tokenizer.decode(group.prompt_token_ids)
    assert opening.endswith("=<|im_end|>\n<|im_start|>assistant\n")  # (the warm-up question)
    for c in group.completions:
        observation = worker.generator.tokenizer.decode(c.token_ids[1:-1])
        # (the turn's stop token was not the template's: its "<|im_end|>" is written too)
        turn_end = (
            "\n" if c.token_ids[0] == worker.generator.tokenizer.eos_token_id else "<|im_end|>\n"
        )
        expected = f"{turn_end}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        assert observation == expected, (c.token_ids, c.loss_mask, c.finish_reason, c.reward_terms)
        assert c.loss_mask == [1] + [0] * (len(c.token_ids) - 2) + [1]
        assert c.logprobs[1:-1] == [0.0] * (len(c.token_ids) - 2) and c.logprobs[0] < 0
        assert c.reward == c.reward_terms["turns"] + c.reward_terms["arithmetic"]


def _step_until(worker: RolloutWorker, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the worker did not get there"
        worker.step()


def test_generation_goes_on_while_remote_scores_are_pending(rollout_worker, tmp_path, monkeypatch):
    """With `use_remote_reward` a group waits for its scores in a thread of its own: while the
    reward service holds the first prompt's scores back (its reward waits for a gate file), the
    replica claims, generates and decodes the next prompt; both groups are pushed once the
    scores come, each with the service's scores."""
    from reward_helpers import GATE_ENV
    from test_remote_rewards import _service, point_client_at, remote_changes

    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))  # (read by the service's worker process)
    with _service() as svc:
        point_client_at(monkeypatch, svc.url)
        worker = rollout_worker(
            remote_changes({"name": "reward_helpers:gated_length"}, batch_size=2),
            {"rollout": {"batch_size": 1}},
        )
        state = worker.session.state
        _enqueue(worker.cfg, state, 1)
        _step_until(
            worker, lambda: len(worker.generator.scoring) == 1 and not worker.generator.generating
        )
        _enqueue(worker.cfg, state, 1, first=1)  # the next prompt, after the first generated
        _step_until(
            worker, lambda: len(worker.generator.scoring) == 2 and not worker.generator.generating
        )
        # The second group was generated while the first one's scores were pending.
        assert worker.num_groups == 0 and state.poll_groups(10) == []
        assert all(not future.done() for future in worker.generator.scoring)
        gate.touch()
        groups = _groups(worker, 2)
    assert [g.prompt.index for g in groups] == [0, 1]
    for g in groups:
        assert g.rewards == [float(len(c.text)) for c in g.completions]
        assert all(
            c.reward_terms == {"reward_helpers:gated_length": float(len(c.text))}
            for c in g.completions
        )
