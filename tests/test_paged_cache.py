"""The engine's paged KV cache: a request's samples share its prompt's blocks, memory follows the
real lengths and comes back, chunked prefill, weight updates at token boundaries."""

from __future__ import annotations

import pytest
import torch
import transformers

from nebula_rl.config import config_from_dict
from nebula_rl.models import load_model, load_tokenizer
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import GenerationRequest, RequestOutput, SamplingParams
from nebula_rl.rollout.torch_engine import TorchEngine


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=None,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(model: torch.nn.Module, ids: list[int], num: int) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=num,
            min_new_tokens=num,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def policy_logprobs(model: torch.nn.Module, ids: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def run(engine: TorchEngine) -> tuple[dict[str, RequestOutput], dict[str, int]]:
    """Step until done: the outputs, and the step each request finished at."""
    outputs, finished, step = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
            finished[out.request_id] = step
        step += 1
    return outputs, finished


@pytest.mark.parametrize("forward", ["fused", "hf"])
def test_samples_sharing_a_prompt_match_separate_requests_and_the_policy(forward: str) -> None:
    model = tiny_model()
    ids = prompt(10)  # (2.5 blocks of 4: the prompt's last block is part-filled)
    sampling = SamplingParams(temperature=1.0, max_tokens=13, seed=7)
    shared = TorchEngine(model, max_num_seqs=8, max_model_len=64, block_size=4, forward=forward)
    group = shared.generate([GenerationRequest(ids, n=4, sampling=sampling)])[0]
    alone = TorchEngine(model, max_num_seqs=8, max_model_len=64, block_size=4, forward=forward)
    singles = alone.generate(
        [
            GenerationRequest(ids, sampling=SamplingParams(temperature=1.0, max_tokens=13, seed=s))
            for s in range(7, 11)  # (sample k of a seeded request draws with seed + k)
        ]
    )
    assert len({tuple(c.token_ids) for c in group.completions}) > 1  # (really sampled)
    for completion, single in zip(group.completions, singles, strict=True):
        assert completion.token_ids == single.completions[0].token_ids
        expected = policy_logprobs(model, ids, completion.token_ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)


def test_a_prompt_is_cached_once_and_every_block_comes_back() -> None:
    engine = TorchEngine(tiny_model(), max_num_seqs=8, max_model_len=64, block_size=4)
    engine.add_request(
        GenerationRequest(prompt(10), n=4, sampling=SamplingParams(max_tokens=9, seed=0))
    )
    engine.step()  # admission: the prompt prefilled once, into 3 blocks
    assert engine.num_running == 4
    assert engine.kv_cache_usage[0] == 3
    engine.step()  # each sample's first generated token takes a block of its own
    assert engine.kv_cache_usage[0] == 3 + 4
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.kv_cache_usage[0])
    # 8 generated tokens are cached per sample (the 9th is sampled, never attended to): 2 blocks.
    assert peak == 3 + 4 * 2
    assert engine.kv_cache_usage[0] == 0
    # n copies of prompt + completion in full-length slots would take 4 x 16 blocks.
    assert peak < 4 * 64 // 4


def test_more_sequences_fit_than_full_length_slots_and_the_rest_wait() -> None:
    model = tiny_model()
    # Room for 2 sequences of max_model_len (2 x 16 blocks of 4, + block 0 + a part-filled one).
    engine = TorchEngine(model, max_num_seqs=16, max_model_len=64, block_size=4, num_kv_blocks=34)
    sampling = SamplingParams(temperature=0, max_tokens=8)
    first = GenerationRequest(prompt(6, seed=1), n=8, sampling=sampling)  # 2 + 8 x 2 blocks
    second = GenerationRequest(prompt(9, seed=2), n=8, sampling=sampling)  # 3 + 8 x 2
    engine.add_request(first)
    engine.add_request(second)
    engine.step()
    # 33 blocks: all of the first (18), then the second's prompt (3) and 6 of its samples (12);
    # its last 2 samples wait for blocks to come back (then a prompt of their own).
    assert engine.num_running == 8 + 6
    outputs, _ = run(engine)
    assert engine.kv_cache_usage[0] == 0
    for request in (first, second):
        want = greedy(model, list(request.prompt_token_ids), 8)
        assert [c.token_ids for c in outputs[request.request_id].completions] == [want] * 8


def test_a_weight_update_mid_run_lands_at_a_token_boundary_for_shared_prompts() -> None:
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    reference = tiny_model(seed=0)
    engine = TorchEngine(model, max_num_seqs=8, max_model_len=64, block_size=4)
    ids = prompt(7)
    request = GenerationRequest(ids, n=3, sampling=SamplingParams(temperature=0, max_tokens=12))
    engine.add_request(request)
    for _ in range(5):
        assert engine.step() == []
    engine.update_weights(other.state_dict(), policy_version=1)
    outputs, _ = run(engine)
    before = greedy(reference, ids, 5)
    # The 6th token onward: the new weights over the prompt's and the first tokens' old cache.
    cache = transformers.DynamicCache(config=reference.config)
    after, token = [], before[-1]
    with torch.inference_mode():
        reference(torch.tensor([ids + before[:-1]]), past_key_values=cache, use_cache=True)
        for _ in range(7):
            logits = other(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            after.append(token)
    for completion in outputs[request.request_id].completions:
        assert completion.token_ids == before + after
        assert completion.version_changes == ((0, 0), (5, 1))


@pytest.mark.parametrize("forward", ["fused", "hf"])
def test_chunked_prefill_matches_a_whole_prefill_and_decoding_goes_on(forward: str) -> None:
    model = tiny_model()
    engine = TorchEngine(
        model,
        max_num_seqs=8,
        max_model_len=96,
        block_size=4,
        max_num_batched_tokens=8,
        chunked_prefill=True,
        forward=forward,
    )
    short = GenerationRequest(
        prompt(5, seed=3), sampling=SamplingParams(temperature=0, max_tokens=12)
    )
    long = GenerationRequest(
        prompt(37, seed=4), sampling=SamplingParams(temperature=0, max_tokens=6)
    )
    engine.add_request(short)
    engine.step()  # the short prompt: prefilled whole (within max_num_batched_tokens)
    engine.add_request(long)
    used = []
    outputs, finished = {}, {}
    step = 1
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id], finished[out.request_id] = out, step
        used.append(engine.kv_cache_usage[0])
        step += 1
    # The running sequence decoded a token every step: done after its 12 tokens, at step 11.
    assert finished[short.request_id] == 11
    # 37 tokens in chunks of 8: steps 1..5, the first token at step 5, 5 more by step 10.
    assert finished[long.request_id] == 10
    whole = TorchEngine(model, max_num_seqs=8, max_model_len=96, block_size=4, forward=forward)
    for request, num in ((short, 12), (long, 6)):
        completion = outputs[request.request_id].completions[0]
        assert completion.token_ids == greedy(model, list(request.prompt_token_ids), num)
        again = whole.generate(
            [GenerationRequest(request.prompt_token_ids, sampling=request.sampling)]
        )
        torch.testing.assert_close(
            torch.tensor(completion.logprobs), torch.tensor(again[0].completions[0].logprobs)
        )
    assert engine.kv_cache_usage[0] == 0


def test_aborting_a_prompt_being_prefilled_in_chunks_gives_its_blocks_back() -> None:
    engine = TorchEngine(
        tiny_model(),
        max_num_seqs=8,
        max_model_len=96,
        block_size=4,
        max_num_batched_tokens=8,
        chunked_prefill=True,
    )
    request = GenerationRequest(prompt(40), n=2, sampling=SamplingParams(max_tokens=4))
    engine.add_request(request)
    engine.step()
    engine.step()
    assert engine.kv_cache_usage[0] == 10  # (the prompt's blocks, taken at admission)
    engine.abort(request.request_id)
    out = engine.step()
    assert [c.finish_reason for c in out[0].completions] == ["abort", "abort"]
    assert engine.kv_cache_usage[0] == 0
    assert not engine.has_unfinished()
    # The engine goes on serving.
    assert (
        len(
            engine.generate([GenerationRequest(prompt(5), sampling=SamplingParams(max_tokens=3))])[
                0
            ]
            .completions[0]
            .token_ids
        )
        == 3
    )


def test_cache_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="num_kv_blocks"):
        TorchEngine(tiny_model(), max_num_seqs=2, max_model_len=64, block_size=4, num_kv_blocks=10)
    with pytest.raises(ValueError, match="block_size"):
        TorchEngine(tiny_model(), max_num_seqs=2, max_model_len=64, block_size=0)


def test_the_rollout_config_sets_chunked_prefill_and_its_chunk() -> None:
    cfg = config_from_dict(
        {
            "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 128},
            "rollout": {
                "backend": "torch",
                "enable_chunked_prefill": True,
                "max_num_batched_tokens": 40,
            },
        }
    )
    model = load_model("tiny:qwen2", seed=0)
    engine = build_engine(cfg, model=model, tokenizer=load_tokenizer("tiny:qwen2"), seed=0)
    assert isinstance(engine, TorchEngine)
    request = GenerationRequest(prompt(80), sampling=SamplingParams(temperature=0, max_tokens=2))
    engine.add_request(request)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    # 80 prompt tokens in chunks of 32 (40 in whole blocks of 32), then the second token
    assert steps == 3 + 1
