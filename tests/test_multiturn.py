"""Multi-turn, tool-using rollouts: the Hermes parser, the tool sandbox, the engine's turns over
one live KV cache, the conversation's observations and rewards, the loss mask, the config."""

from __future__ import annotations

import json
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

from conftest import least_squares_slope
from nebula_rl import local
from nebula_rl.config import ConfigError, MultiTurnRolloutConfig, config_from_dict, load_config
from nebula_rl.models import build_char_tokenizer
from nebula_rl.policy.batching import collate_groups
from nebula_rl.protocol import Completion, Prompt, RolloutGroup, from_json, to_json
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.multiturn import ArithmeticEnvironment, MultiTurn
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.utils.tools import ToolLimits, calculator, parse_tool_calls, run_tool, tool_schema

ROOT = Path(__file__).resolve().parents[1]
COSMOS_MULTITURN = (
    ROOT
    / "tests/data/cosmos-rl/configs/qwen2-5/qwen2-5-multiturn-3b-p-fsdp1-tp1-r-tp1-pp1-grpo.toml"
)

BAD_TOOLS = '''
import socket, time

def boom(x: int) -> str:
    """Fail.

    Args:
        x: anything.
    """
    raise RuntimeError("broken tool")

def sleepy() -> str:
    """Hang."""
    time.sleep(100)
    return "woke"

def spin() -> str:
    while True:
        pass

def hog() -> str:
    return str(len(bytearray(1 << 31)))

def net() -> str:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    return "connected"

def secrets() -> str:
    import os
    return " ".join(sorted(k for k in os.environ if "TOKEN" in k or "REDIS" in k))
'''


@pytest.fixture(scope="module")
def bad_tools(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A module of misbehaving tools, importable in the sandbox (its folder on sys.path)."""
    folder = tmp_path_factory.mktemp("tools")
    (folder / "bad_tools.py").write_text(textwrap.dedent(BAD_TOOLS))
    sys.path.insert(0, str(folder))
    yield "bad_tools"
    sys.path.remove(str(folder))


# -- parser and tools --------------------------------------------------------------------------


def test_parse_hermes_tool_calls():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
        "</tool_call><tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", {"expression": "12*7"}),
        ("calculator", {"expression": "1+1"}),
    ]
    assert calls[2].error is not None and "JSON" in calls[2].error
    assert calls[3].error is not None and "name" in calls[3].error
    assert parse_tool_calls("no call here") == []


def test_calculator_and_schema():
    assert calculator("(12 + 30) * 4 / 7") == "24"
    assert calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calculator("__import__('os').system('true')")
    schema = tool_schema("calculator")
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_sandbox_contains_failures(bad_tools):
    limits = ToolLimits(timeout_s=2.0, cpu_s=1, memory_mb=256)
    assert run_tool("calculator", {"expression": "6*7"}, limits).text == "42"
    raised = run_tool(f"{bad_tools}:boom", {"x": 1}, limits)
    assert not raised.ok and "RuntimeError: broken tool" in raised.text
    hung = run_tool(f"{bad_tools}:sleepy", {}, limits)
    assert not hung.ok and "timed out" in hung.text
    memory = run_tool(f"{bad_tools}:hog", {}, limits)
    assert not memory.ok and "memory" in memory.text
    network = run_tool(f"{bad_tools}:net", {}, limits)
    assert not network.ok and "network" in network.text, network.text
    unknown = run_tool(f"{bad_tools}:missing", {}, limits)
    assert not unknown.ok and "no function" in unknown.text


def test_a_tool_does_not_see_the_jobs_secrets(bad_tools, monkeypatch):
    monkeypatch.setenv("NEBULA_TOKEN", "job-secret")
    monkeypatch.setenv("NEBULA_REDIS_URL", "redis://:pw@127.0.0.1:1/0")
    seen = run_tool(f"{bad_tools}:secrets", {}, ToolLimits(timeout_s=10.0))
    assert seen.ok and seen.text == "", seen.text


def test_sandbox_cpu_limit_kills_a_busy_loop(bad_tools):
    spun = run_tool(f"{bad_tools}:spin", {}, ToolLimits(timeout_s=60.0, cpu_s=1))
    assert not spun.ok and "CPU time limit" in spun.text, spun.text


# -- the engine: turns over one live KV cache ---------------------------------------------------


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=None,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("forward", ["fused", "hf"])
def test_engine_turns_reuse_the_kv_cache(forward):
    """Two samples, each answered twice with an observation: the engine's log-probs of every
    sampled token equal the model's over the whole sequence recomputed at once, observation
    tokens are appended as given (log-prob 0), the only prefill is the prompt's, each
    observation runs through one forward (`extend`) and every sampled token after the first
    through one decode row."""
    model = _tiny_model()
    engine = TorchEngine(model, max_num_seqs=4, max_model_len=128, block_size=4, forward=forward)
    prefilled: list[int] = []
    decoded: list[int] = []
    extended: list[int] = []
    prefill, decode, extend = (
        engine._forward.prefill,
        engine._forward.decode,
        engine._forward.extend,
    )

    def counting_prefill(tokens, *args, **kwargs):
        prefilled.append(int(tokens.shape[0] * tokens.shape[1]))
        return prefill(tokens, *args, **kwargs)

    def counting_decode(tokens, *args, **kwargs):
        decoded.append(int(tokens.shape[0]))
        return decode(tokens, *args, **kwargs)

    def counting_extend(tokens, *args, **kwargs):
        extended.append(int(tokens.shape[0]))
        return extend(tokens, *args, **kwargs)

    engine._forward.prefill = counting_prefill  # type: ignore[method-assign]
    engine._forward.extend = counting_extend  # type: ignore[method-assign]
    engine._forward.decode = counting_decode  # type: ignore[method-assign]
    observation = [7, 8, 9, 10, 11, 12]
    calls: list[tuple[int, int]] = []

    def continuation(index: int, tokens: list[int]) -> Future[list[int] | None]:
        calls.append((index, len(tokens)))
        future: Future[list[int] | None] = Future()
        turns = sum(i == index for i, _ in calls)
        future.set_result(observation if turns <= 2 else None)
        return future

    prompt = [3, 17, 40, 41, 99, 5, 6]
    stops = tuple(range(0, 128, 4))  # (a turn ends soon)
    sampling = SamplingParams(temperature=1.0, max_tokens=100, stop_token_ids=stops, seed=11)
    request = GenerationRequest(prompt, n=2, sampling=sampling, continuation=continuation)
    (output,) = engine.generate([request])

    total = 0
    for c in output.completions:
        assert c.finish_reason == "stop" and len(c.observations) == 2
        for start, end in c.observations:
            assert c.token_ids[start:end] == observation
            assert c.logprobs[start:end] == [0.0] * len(observation)
            assert c.token_ids[start - 1] in stops  # (each turn ended with its stop token)
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        sampled = torch.ones(len(c.token_ids), dtype=torch.bool)
        for start, end in c.observations:
            sampled[start:end] = False
        got = torch.tensor(c.logprobs)
        torch.testing.assert_close(got[sampled], expected[sampled], atol=2e-4, rtol=0)
        total += len(c.token_ids)
    assert sum(prefilled) == len(prompt)  # the prompt once, never the conversation again
    assert extended == [len(observation)] * 4  # each observation in one forward
    # every sampled token after each sample's first: one decode row; observations none
    assert sum(decoded) == total - 2 - 4 * len(observation)
    assert engine.kv_cache_usage[0] == 0  # blocks all given back


def test_engine_turn_versions_follow_the_update_that_landed_while_it_waited():
    """An update lands while a sample waits for its observation: the tokens before keep the old
    version, the observation and everything after it record the new one; a second update one
    step after the observation lands between two sampled tokens."""
    engine = TorchEngine(_tiny_model(), max_num_seqs=2, max_model_len=96, block_size=4)
    answer: Future[list[int] | None] = Future()
    turns: list[int] = []

    def continuation(index: int, tokens: list[int]) -> Future[list[int] | None]:
        turns.append(len(tokens))
        done: Future[list[int] | None] = Future()
        done.set_result(None)
        return answer if len(turns) == 1 else done

    stops = tuple(range(0, 128, 8))
    sampling = SamplingParams(temperature=1.0, max_tokens=80, stop_token_ids=stops, seed=7)
    request = GenerationRequest([5, 6, 7], n=1, sampling=sampling, continuation=continuation)
    engine.add_request(request)
    for _ in range(80):
        if turns:
            break
        assert not engine.step(), "the first turn ended without a stop token"
    first_turn = turns[0]
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.update_weights(weights, policy_version=1)
    observation = [9, 11, 13]
    answer.set_result(observation)
    engine.step()  # the observation in, and one token sampled after it
    engine.update_weights(weights, policy_version=2)
    outputs = []
    while not outputs:
        outputs = engine.step()
    (completion,) = outputs[0].completions
    assert completion.observations == ((first_turn, first_turn + 3),)
    versions = completion.policy_versions
    assert versions[:first_turn] == [0] * first_turn
    assert versions[first_turn : first_turn + 4] == [1] * 4  # observation + its next token
    assert len(versions) > first_turn + 4 and set(versions[first_turn + 4 :]) == {2}


def test_engine_abort_while_a_turn_waits():
    engine = TorchEngine(_tiny_model(), max_num_seqs=2, max_model_len=64, block_size=4)
    waiting: Future[list[int] | None] = Future()
    sampling = SamplingParams(max_tokens=40, stop_token_ids=tuple(range(128)), seed=1)
    request = GenerationRequest(
        [1, 2, 3], n=1, sampling=sampling, continuation=lambda i, t: waiting
    )
    engine.add_request(request)
    engine.step()  # prefill; the first token stops the turn: it waits for its continuation
    assert engine.num_running == 0 and engine.has_unfinished()
    engine.abort(request.request_id)
    (output,) = engine.step()
    assert output.completions[0].finish_reason == "abort"
    assert len(output.completions[0].token_ids) == 1
    assert engine.kv_cache_usage[0] == 0


# -- conversations ------------------------------------------------------------------------------


def _cfg(**multi_turn):
    return config_from_dict(
        {
            "train": {"train_policy": {"type": "grpo", "reward_function": "arithmetic"}},
            "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 128},
            "rollout": {
                "backend": "torch",
                "max_response_length": 64,
                "multi_turn_config": {"enable": True, **multi_turn},
            },
        }
    )


def test_tool_errors_are_observations_with_a_penalty(bad_tools):
    """A tool that raises and one that hangs: the conversation goes on with their errors as
    `tool` messages, each scored `tool_error_reward`; the observation's tokens are what the
    chat template adds after the assistant's turn."""
    cfg = _cfg(
        enable_tools=True,
        tools=["calculator", f"{bad_tools}:boom", f"{bad_tools}:sleepy"],
        tool_timeout=1.0,
        tool_error_reward=-0.5,
    )
    tokenizer = build_char_tokenizer()
    with ThreadPoolExecutor(2) as pool:
        runner = MultiTurn(cfg, tokenizer, pool)
        request, (conversation,) = runner.request(
            "What is 6*7?", "42", n=1, sampling=SamplingParams()
        )
        turn = (
            '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "sleepy", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        )
        tokens = tokenizer.encode(turn, add_special_tokens=False) + [tokenizer.eos_token_id]
        observation = conversation.turn_ended(tokens)
    assert observation is not None
    text = tokenizer.decode(observation)
    assert text.startswith("\n<|im_start|>tool\nerror: RuntimeError: broken tool<|im_end|>")
    assert "timed out" in text and "tool\n42<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert conversation.rewards == [-1.0]
    # The prompt and the grown conversation render to the same tokens as the template does.
    whole = tokenizer.apply_chat_template(
        conversation.messages, tokenize=False, add_generation_prompt=True
    )
    grown = list(request.prompt_token_ids) + tokens + observation
    assert tokenizer.decode(grown) == whole


def test_arithmetic_environment_rewards_the_warmup_turn():
    cfg = MultiTurnRolloutConfig(enable=True, environment="arithmetic")
    env = ArithmeticEnvironment(cfg)
    (first,) = env.reset("3+4=", "7")
    assert first == ArithmeticEnvironment(cfg).reset("3+4=", "7")[0]  # alike for its samples
    a, b = (int(x) for x in first["content"].rstrip("=").split("+"))
    step = env.step(str(a + b))
    assert step.reward == 1.0 and step.messages == [{"role": "user", "content": "3+4="}]
    assert env.step("7").done


# -- training side -------------------------------------------------------------------------------


def test_observation_tokens_are_out_of_the_loss():
    completion = Completion(
        token_ids=[10, 11, 12, 13, 14, 15],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
        text="",
        finish_reason="stop",
        version_changes=[(0, 0)],
        loss_mask=[1, 1, 0, 0, 1, 1],
    )
    plain = Completion([20, 21], [-0.5, -0.6], "", "stop", [(0, 0)])
    group = RolloutGroup(Prompt("0:0", 0, 0, "q", "a"), [1, 2, 3], [completion, plain])
    group = from_json(RolloutGroup, to_json(group))  # (the mask travels)
    assert group.completions[0].loss_mask == [1, 1, 0, 0, 1, 1]
    batch = collate_groups([group], torch.zeros(2), pad_id=0)
    # Target space: position t predicts input t + 1; the prompt is 3 tokens.
    assert batch.target_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert batch.target_mask[1, :4].tolist() == [0, 0, 1, 1]
    assert float(batch.target_mask.sum()) == 6  # token-mean's count: sampled tokens only


# -- config ----------------------------------------------------------------------------------------


def test_multi_turn_config_keys():
    cfg = load_config(COSMOS_MULTITURN)
    m = cfg.rollout.multi_turn_config
    assert m.enable and m.enable_tools and m.enable_thinking and m.max_assistant_turns == 5
    with pytest.raises(ConfigError, match="enable = true"):
        config_from_dict({"rollout": {"multi_turn_config": {"max_assistant_turns": 3}}})
    with pytest.raises(ConfigError, match="add_generation_prompt"):
        _cfg(continue_final_message=True)


# -- learning ------------------------------------------------------------------------------------


def _learning_run(tmp_path: Path, *, sft_steps: int, rl_steps: int) -> list[float]:
    """configs/demo_multiturn.toml as shipped (128 conversations a step) but shorter: a short
    SFT warm start of demo_sft.toml, then `rl_steps` multi-turn GRPO steps in this process;
    each step's mean reward."""
    sft = load_config(ROOT / "configs" / "demo_sft.toml")
    sft.train.output_dir, sft.train.timestamp = str(tmp_path), "warm"
    sft.train.max_num_steps = sft_steps
    local.run(sft)
    cfg = load_config(ROOT / "configs" / "demo_multiturn.toml")
    cfg.train.output_dir, cfg.train.timestamp = str(tmp_path), "rl"
    cfg.policy.model_name_or_path = str(tmp_path / "warm" / "safetensors" / "final")
    cfg.policy.warmstart_config = None
    cfg.train.max_num_steps = rl_steps
    run_dir = local.run(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward_mean"] for r in records if "reward_mean" in r]


@pytest.mark.slow
def test_multiturn_demo_learns(tmp_path):
    """The two-turn arithmetic demo learns on CPU: from the demo's SFT warm start, over 20
    steps of 128 conversations, the least-squares slope of the steps' mean reward (0..2) is at
    least 0.003 per step. Measured (2026-11-29): 0.0094 over 16 steps, whose noise gives a
    standard error of 0.0031 (0.0022 over 20 steps), so the bound sits ~3 standard errors
    below the measured trend; a run that does not learn has slope 0. (The mean of a few
    steps against a few others, the earlier form, moved by +0.06 to +0.17 between runs: 64
    conversations a step were too few.)"""
    rewards = _learning_run(tmp_path, sft_steps=110, rl_steps=20)
    assert len(rewards) == 20
    assert least_squares_slope(rewards) >= 0.003, rewards


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool.function.name }}"
    "({{ tool.function.parameters.properties | tojson }})\n{% endfor %}</tools>\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>{% endif %}{% endif %}"
)
"""A Qwen2.5-style template that shows tool schemas and honours `enable_thinking`."""


def test_the_cosmos_multiturn_config_runs_shrunk_to_cpu(tmp_path):
    """cosmos-rl's multi-turn GRPO config with the tiny model, the arithmetic task, a chat
    template file of our own (cosmos-rl's is a file of its package) and one local step; its
    template is read when rollouts start, and a missing one is named then."""
    cfg = load_config(COSMOS_MULTITURN)
    cfg.train.output_dir, cfg.train.timestamp = str(tmp_path), "run"
    cfg.policy.model_name_or_path = "tiny:qwen2"
    cfg.policy.model_max_length = 512
    cfg.train.param_dtype = "float32"
    cfg.rollout.backend = "torch"
    cfg.rollout.n_generation, cfg.rollout.batch_size = 2, 2
    cfg.rollout.max_response_length = 24
    cfg.train.train_batch_per_replica = cfg.grpo.mini_batch = 4
    cfg.train.max_num_steps = 1
    cfg.train.ckpt.enable_checkpoint = False
    cfg.logging.logger = ["console"]
    cfg.grpo.dataset.name = "builtin:arithmetic"
    cfg.grpo.dataset.kwargs = {"num_samples": 8}
    cfg.grpo.prompt_column_name, cfg.grpo.response_column_name = "prompt", "answer"
    with pytest.raises(ValueError, match="custom_chat_template_path: no file"):
        local.run(cfg)
    template = tmp_path / "tool_template.jinja2"
    template.write_text(TOOL_TEMPLATE)
    cfg.rollout.multi_turn_config.custom_chat_template_path = str(template)
    tokenizer = build_char_tokenizer()
    with ThreadPoolExecutor(1) as pool:
        request, _ = MultiTurn(cfg, tokenizer, pool).request(
            "1+2=", "3", n=1, sampling=SamplingParams()
        )
    prompt = tokenizer.decode(request.prompt_token_ids)
    assert 'calculator({"expression":' in prompt and prompt.endswith(
        "<|im_start|>assistant\n<think>"
    )
    run_dir = local.run(cfg)
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["num_sequences"] == 4
