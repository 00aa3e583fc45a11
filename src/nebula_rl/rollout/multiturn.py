"""Multi-turn rollouts: environments that answer the model's turns, and the conversations that
drive the engine turn by turn.

A conversation is one engine sample (`GenerationRequest.continuation`): the engine generates an
assistant turn; when it stops, :meth:`Conversation.turn_ended` decodes the turn, hands it to the
sample's :class:`Environment` (in a thread pool: a tool call runs in a sandboxed process) and
returns the observation's tokens, which the engine appends to the live sequence (its KV cache
kept) before it decodes the next turn. The conversation ends when the environment says so, after
`max_assistant_turns` turns, or when the completion reaches `max_response_length` tokens (prompt
excluded; observations count, as in cosmos-rl).

The completion that comes back is the whole conversation after the prompt; the observation's
tokens are marked (`Completion.observations`) so training leaves them out of the loss. Rewards:
each environment step returns one (a per-turn reward, e.g. a penalty for a failed tool call);
the configured reward functions score the last assistant turn against the reference; a
completion's reward is their sum.

Observation tokens are what the chat template adds after the assistant's turn: the template is
rendered before and after the new messages and the difference taken as text, after what the
template writes to close the turn (ChatML's `<|im_end|>\n`) less the stop token the model
sampled itself. A template that rewrites
earlier turns (e.g. one that drops past thinking) is refused by name.
"""

from __future__ import annotations

import random
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_rl.config import Config, MultiTurnRolloutConfig
from nebula_rl.data import prompt_messages
from nebula_rl.rewards import Scored
from nebula_rl.rollout.engine import Completion, GenerationRequest, SamplingParams
from nebula_rl.utils.tools import ToolLimits, parse_tool_calls, run_tool, tool_schema

__all__ = [
    "ENVIRONMENTS",
    "ArithmeticEnvironment",
    "Conversation",
    "Environment",
    "MultiTurn",
    "Step",
    "ToolEnvironment",
    "loss_mask",
    "with_turn_rewards",
]

Message = dict[str, Any]
_MARK = "\x00end-of-turn\x00"
"""Marks where a turn's content ends in a rendered conversation."""


@dataclass(frozen=True, slots=True)
class Step:
    """What an environment answers to one assistant turn."""

    messages: list[Message] = field(default_factory=list)
    """The observation: messages appended to the conversation (e.g. `{"role": "tool", ...}`)."""
    reward: float = 0.0
    """This turn's reward."""
    done: bool = False
    """The conversation ends here (also when `messages` is empty)."""


class Environment(ABC):
    """One conversation's counterpart; a fresh one per sample, made with the config, the
    system prompt (`train_policy.system_prompt`) and the schemas of the configured tools."""

    def __init__(
        self,
        cfg: MultiTurnRolloutConfig,
        *,
        system_prompt: str = "",
        schemas: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.cfg, self.system_prompt, self.schemas = cfg, system_prompt, list(schemas)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """Schemas of the tools the chat template shows the model (none by default)."""
        return []

    @abstractmethod
    def reset(self, prompt: str | list[Message], reference: str) -> list[Message]:
        """The conversation's opening messages for a dataset row. Every sample of one prompt
        must get the same (they share the prompt's KV cache)."""

    @abstractmethod
    def step(self, text: str) -> Step:
        """Answer the assistant's turn `text` (its stop token left out)."""


class ToolEnvironment(Environment):
    """The model calls tools (`rollout.multi_turn_config.tools`) with Hermes `<tool_call>`s;
    each call runs sandboxed and its result (or error) comes back as a `tool` message. A turn
    without a call ends the conversation. A failed call adds `tool_error_reward`."""

    def __init__(
        self,
        cfg: MultiTurnRolloutConfig,
        *,
        system_prompt: str = "",
        schemas: Sequence[dict[str, Any]] = (),
    ) -> None:
        super().__init__(cfg, system_prompt=system_prompt, schemas=schemas)
        self.enabled = cfg.enable_tools
        self.specs = {
            s["function"]["name"]: spec for s, spec in zip(schemas, cfg.tools, strict=True)
        }
        self.limits = ToolLimits(
            timeout_s=cfg.tool_timeout, cpu_s=cfg.tool_cpu_seconds, memory_mb=cfg.tool_memory_mb
        )
        self.error_reward = cfg.tool_error_reward

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.schemas if self.enabled else []

    def reset(self, prompt: str | list[Message], reference: str) -> list[Message]:
        return prompt_messages(prompt, self.system_prompt)

    def step(self, text: str) -> Step:
        calls = parse_tool_calls(text) if self.enabled else []
        if not calls:
            return Step(done=True)
        messages, reward = [], 0.0
        for call in calls:
            if call.error is not None:
                ok, output = False, f"error: {call.error}"
            elif call.name not in self.specs:
                ok, output = False, f"error: no tool {call.name!r} (tools: {sorted(self.specs)})"
            else:
                result = run_tool(self.specs[call.name], call.arguments, self.limits)
                ok, output = result.ok, result.text
            reward += 0.0 if ok else self.error_reward
            messages.append({"role": "tool", "content": output})
        return Step(messages, reward)


class ArithmeticEnvironment(Environment):
    """The CPU demo's two-turn task on `builtin:arithmetic` rows: first a warm-up sum of two
    digits (drawn from the prompt, so alike for the samples of one prompt), rewarded 1 when the
    turn is its value; then the row's own question, which the reward functions score."""

    def reset(self, prompt: str | list[Message], reference: str) -> list[Message]:
        if not isinstance(prompt, str):
            raise ValueError(
                'rollout.multi_turn_config.environment = "arithmetic" needs text prompts'
            )
        rng = random.Random(zlib.crc32(prompt.encode()))
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        self.warmup, self.question, self.turns = str(a + b), prompt, 0
        return [{"role": "user", "content": f"{a}+{b}="}]

    def step(self, text: str) -> Step:
        self.turns += 1
        if self.turns > 1:
            return Step(done=True)
        reward = 1.0 if text.strip() == self.warmup else 0.0
        return Step([{"role": "user", "content": self.question}], reward)


ENVIRONMENTS: dict[str, type[Environment]] = {
    "tools": ToolEnvironment,
    "arithmetic": ArithmeticEnvironment,
}


class Conversation:
    """One sample's conversation: its environment, messages, and where its current turn
    starts in the completion's tokens."""

    def __init__(self, runner: MultiTurn, env: Environment, messages: list[Message]) -> None:
        self.runner, self.env, self.messages = runner, env, list(messages)
        self.turn_start = 0
        """Token index (in the completion) of the current assistant turn."""
        self.num_turns = 0
        self.rewards: list[float] = []
        """Each environment step's reward."""
        self.last_text = ""
        """The last assistant turn handed to the environment."""

    def turn_ended(self, tokens: list[int]) -> list[int] | None:
        """The completion so far ends an assistant turn (with its stop token): the observation's
        tokens to append, or None to end the conversation."""
        text = self.runner.decode(tokens[self.turn_start : -1])
        self.last_text = text
        self.num_turns += 1
        if self.num_turns >= self.runner.cfg.max_assistant_turns:
            return None
        step = self.env.step(text)
        self.rewards.append(step.reward)
        if step.done or not step.messages:
            return None
        before = [*self.messages, {"role": "assistant", "content": text}]
        observation = self.runner.observation_ids(before, step.messages, tokens[-1])
        self.messages = before + step.messages
        self.turn_start = len(tokens) + len(observation)
        return observation

    def final_text(self, completion: Completion) -> str:
        """The last assistant turn of the finished completion (what the reward functions
        score)."""
        if self.turn_start > len(completion.token_ids):  # (the observation did not fit)
            return self.last_text
        tokens = list(completion.token_ids[self.turn_start :])
        if completion.finish_reason == "stop" and tokens:
            tokens.pop()
        return self.runner.decode(tokens)


class MultiTurn:
    """Builds multi-turn requests from `rollout.multi_turn_config` (see the module docstring).

    `executor` runs the environments' steps (tool calls wait on their sandbox there, not in the
    engine's loop)."""

    def __init__(self, cfg: Config, tokenizer: Any, executor: Executor) -> None:
        self.cfg = cfg.rollout.multi_turn_config
        self.tokenizer = tokenizer
        self.executor = executor
        self.system_prompt = cfg.grpo.system_prompt
        path = self.cfg.custom_chat_template_path
        if path is not None and not Path(path).is_file():
            raise ValueError(
                f"rollout.multi_turn_config.custom_chat_template_path: no file {path!r} "
                f"(from {Path.cwd()})"
            )
        self.template = Path(path).read_text() if path is not None else None
        if self.template is None and tokenizer.chat_template is None:
            raise ValueError(
                "rollout.multi_turn_config.enable needs a chat template: the tokenizer has none; "
                "set custom_chat_template_path"
            )
        self.schemas = (
            [tool_schema(spec) for spec in self.cfg.tools]
            if self.cfg.environment == "tools"
            else []
        )

    def environment(self) -> Environment:
        """A fresh environment of the configured kind."""
        kind = ENVIRONMENTS[self.cfg.environment]
        return kind(self.cfg, system_prompt=self.system_prompt, schemas=self.schemas)

    def request(
        self,
        prompt: str | list[Message],
        reference: str,
        *,
        n: int,
        sampling: SamplingParams,
    ) -> tuple[GenerationRequest, list[Conversation]]:
        """A request of `n` conversations on one dataset row, and the conversations (their
        `final_text` and `rewards` score the completions)."""
        conversations = []
        for _ in range(n):
            env = self.environment()
            conversations.append(Conversation(self, env, env.reset(prompt, reference)))
        c = self.cfg
        text = self.render(
            conversations[0].messages,
            tools=conversations[0].env.tool_schemas(),
            add_generation_prompt=c.add_generation_prompt,
            continue_final_message=c.continue_final_message,
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)

        def continuation(index: int, tokens: list[int]) -> Future[list[int] | None]:
            return self.executor.submit(conversations[index].turn_ended, tokens)

        request = GenerationRequest(ids, n=n, sampling=sampling, continuation=continuation)
        return request, conversations

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
    ) -> str:
        """`messages` as text under the chat template (`enable_thinking` passed to it)."""
        text: Any = self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools or None,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            enable_thinking=self.cfg.enable_thinking,
            tokenize=False,
        )
        return str(text)

    def observation_ids(
        self, before: list[Message], new: list[Message], stop_token: int
    ) -> list[int]:
        """Tokens that follow the assistant turn ending `before` (with `stop_token`) when the
        messages `new` are appended: the rest of the template after the stop token, the new
        messages and, with `add_generation_prompt`, the next assistant header."""
        tools = self.schemas if self.cfg.enable_tools else None
        old = self.render(before, tools=tools)
        extended = self.render(
            before + new, tools=tools, add_generation_prompt=self.cfg.add_generation_prompt
        )
        if not extended.startswith(old):
            raise ValueError(
                "rollout.multi_turn_config: the chat template renders earlier turns differently "
                "once a message is added (e.g. it drops past thinking), so a conversation cannot "
                "grow token by token; use a template that does not"
            )
        # What the template writes after the turn's content (ChatML: "<|im_end|>\n"); the part
        # the model's stop token already wrote is not repeated.
        marked = [*before[:-1], {**before[-1], "content": before[-1]["content"] + _MARK}]
        rendered = self.render(marked, tools=tools)
        after_turn = rendered[rendered.rindex(_MARK) + len(_MARK) :]
        stop_text = str(self.tokenizer.decode([stop_token], skip_special_tokens=False))
        if stop_text and after_turn.startswith(stop_text):
            after_turn = after_turn[len(stop_text) :]
        text = after_turn + extended[len(old) :]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        """A turn's text."""
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))


def loss_mask(completion: Completion) -> list[int]:
    """1 on the tokens the model sampled, 0 on the observations' (empty: all sampled)."""
    if not completion.observations:
        return []
    mask = [1] * len(completion.token_ids)
    for start, end in completion.observations:
        mask[start:end] = [0] * (end - start)
    return mask


def with_turn_rewards(
    scored: Sequence[Scored], turn_rewards: Sequence[Sequence[float]]
) -> list[Scored]:
    """The reward functions' scores plus each conversation's per-turn rewards
    (`Conversation.rewards`; their sum, also recorded as the term `turns`)."""
    out = []
    for s, rewards in zip(scored, turn_rewards, strict=True):
        turns = sum(rewards)
        out.append(Scored(s.reward + turns, {**s.terms, "turns": turns}))
    return out
