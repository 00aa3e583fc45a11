"""Generation engine: HF equality, log-probs, sampling, weight updates, pause/resume, threads."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import transformers

from nebula_rl.rollout.engine import (
    Completion,
    GenerationRequest,
    SamplingParams,
    engine_class,
    version_changes_for,
)
from nebula_rl.rollout.torch_engine import TorchEngine

CONFIGS = {
    "qwen2": transformers.Qwen2Config,
    "llama": transformers.LlamaConfig,
    "qwen3": transformers.Qwen3Config,
    "gemma": transformers.GemmaConfig,  # not supported by the compact forward: HF-module path
}


def tiny_model(
    arch: str = "qwen2", seed: int = 0, initializer_range: float = 0.1
) -> torch.nn.Module:
    """The project's tiny shape (random init; initializer_range 0.1 by default so that greedy
    outputs vary)."""
    torch.manual_seed(seed)
    cfg = CONFIGS[arch](
        vocab_size=128,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        eos_token_id=None,  # no eos: HF generate with min_new_tokens would suppress it
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def make_prompts(num: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [3, 11, 6, 17, 9, 24, 5, 13]
    return [
        torch.randint(0, 128, (lengths[i % len(lengths)],), generator=generator).tolist()
        for i in range(num)
    ]


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy_after_update(
    old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], before: list[int], num: int
) -> list[int]:
    """Greedy tokens after a weight update that keeps the KV cache computed by the old weights."""
    cache = transformers.DynamicCache(config=old.config)
    out, token = [], before[-1]
    with torch.inference_mode():
        old(torch.tensor([prompt + before[:-1]]), past_key_values=cache, use_cache=True)
        for _ in range(num):
            logits = new(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
    return out


def recomputed_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], sampling: SamplingParams
) -> torch.Tensor:
    """The policy's log-probs of `tokens`, teacher-forced, under the same sampling transform."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= sampling.top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "gemma"])
def test_greedy_matches_hf_generate(arch: str) -> None:
    model = tiny_model(arch)
    # Fewer slots than requests and different lengths: requests join as others finish.
    engine = TorchEngine(model, max_num_seqs=3, max_model_len=96)
    assert engine.forward_impl == ("hf" if arch == "gemma" else "fused")
    prompts = make_prompts(7)
    requests = [
        GenerationRequest(p, sampling=SamplingParams(temperature=0, max_tokens=6 + 3 * i))
        for i, p in enumerate(prompts)
    ]
    outputs = engine.generate(requests)
    for request, output in zip(requests, outputs, strict=True):
        (completion,) = output.completions
        expected = hf_greedy(model, list(request.prompt_token_ids), request.sampling.max_tokens)
        assert completion.token_ids == expected
        assert completion.finish_reason == "length"
        assert completion.version_changes == ((0, 0),)


def test_hf_module_forward_matches_compact_forward() -> None:
    model = tiny_model("qwen2")
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    requests = [GenerationRequest(p, n=2, sampling=sampling) for p in make_prompts(4)]
    fused = TorchEngine(model, max_num_seqs=8, max_model_len=64).generate(requests)
    hf = TorchEngine(model, max_num_seqs=8, max_model_len=64, forward="hf").generate(requests)
    for a, b in zip(fused, hf, strict=True):
        for ca, cb in zip(a.completions, b.completions, strict=True):
            assert ca.token_ids == cb.token_ids
            assert torch.allclose(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, max_tokens=24),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=24),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.8, max_tokens=24),
    ],
    ids=["t1", "t0.7-topk", "t1.3-topk-topp"],
)
def test_logprobs_match_policy_recompute(sampling: SamplingParams) -> None:
    model = tiny_model("qwen2")
    engine = TorchEngine(model, max_num_seqs=16, max_model_len=64)
    outputs = engine.generate(
        [GenerationRequest(p, n=3, sampling=sampling) for p in make_prompts(5)]
    )
    diffs = []
    for output in outputs:
        for completion in output.completions:
            expected = recomputed_logprobs(
                model, list(output.prompt_token_ids), completion.token_ids, sampling
            )
            diffs.append((expected - torch.tensor(completion.logprobs)).abs())
    max_diff = torch.cat(diffs).max().item()
    print(f"max |engine - policy| log-prob ({sampling}): {max_diff:.2e}", file=sys.stderr)
    assert max_diff < 1e-4


def test_sampled_frequencies_follow_the_distribution() -> None:
    model = tiny_model("qwen2")
    prompt = make_prompts(1)[0]
    with torch.inference_mode():
        probs = model(torch.tensor([prompt])).logits[0, -1].float().div(0.8).softmax(-1)
    engine = TorchEngine(model, max_num_seqs=256, max_model_len=32, seed=7)
    sampling = SamplingParams(temperature=0.8, max_tokens=1)
    (output,) = engine.generate([GenerationRequest(prompt, n=4000, sampling=sampling)])
    tokens = torch.tensor([c.token_ids[0] for c in output.completions])
    empirical = torch.bincount(tokens, minlength=128).float() / len(tokens)
    total_variation = 0.5 * (empirical - probs).abs().sum().item()
    assert total_variation < 0.08  # ~0.03 expected from 4000 samples over 128 tokens


def test_top_k_and_top_p_restrict_the_support() -> None:
    model = tiny_model("qwen2")
    engine = TorchEngine(model, max_num_seqs=32, max_model_len=64)
    prompts = make_prompts(4)
    greedy = engine.generate(
        [
            GenerationRequest(p, sampling=SamplingParams(temperature=0, max_tokens=10))
            for p in prompts
        ]
    )
    top1 = engine.generate(
        [GenerationRequest(p, sampling=SamplingParams(top_k=1, max_tokens=10)) for p in prompts]
    )
    tiny_p = engine.generate(
        [GenerationRequest(p, sampling=SamplingParams(top_p=1e-6, max_tokens=10)) for p in prompts]
    )
    for g, a, b in zip(greedy, top1, tiny_p, strict=True):
        assert a.completions[0].token_ids == g.completions[0].token_ids
        assert b.completions[0].token_ids == g.completions[0].token_ids
        assert a.completions[0].logprobs == [0.0] * 10


def test_seeded_samples_do_not_depend_on_the_batch() -> None:
    model = tiny_model("qwen2")
    prompt = make_prompts(1)[0]
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=11)
    alone = TorchEngine(model, max_num_seqs=4, max_model_len=64).generate(
        [GenerationRequest(prompt, n=3, sampling=sampling)]
    )[0]
    crowd = [
        GenerationRequest(p, n=2, sampling=SamplingParams(max_tokens=9)) for p in make_prompts(5)
    ]
    engine = TorchEngine(model, max_num_seqs=6, max_model_len=64, seed=5)
    mixed = engine.generate(
        [*crowd[:3], GenerationRequest(prompt, n=3, sampling=sampling), *crowd[3:]]
    )
    single = TorchEngine(model, max_num_seqs=4, max_model_len=64).generate(
        [GenerationRequest(prompt, sampling=SamplingParams(max_tokens=16, seed=12))]
    )[0]
    assert [c.token_ids for c in mixed[3].completions] == [c.token_ids for c in alone.completions]
    # Sample i of a seeded request uses seed + i.
    assert alone.completions[1].token_ids == single.completions[0].token_ids
    assert alone.completions[0].token_ids != alone.completions[1].token_ids


class _SpaceTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f" t{i}" for i in ids)


def test_stop_tokens_stop_strings_and_eos() -> None:
    model = tiny_model("qwen2")
    prompt = make_prompts(1)[0]
    engine = TorchEngine(model, max_num_seqs=4, max_model_len=64, tokenizer=_SpaceTokenizer())
    reference = hf_greedy(model, prompt, 20)
    stop_token = reference[5]
    cut = reference.index(stop_token) + 1
    outputs = engine.generate(
        [
            GenerationRequest(
                prompt,
                sampling=SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_token,)),
            ),
            GenerationRequest(
                prompt,
                sampling=SamplingParams(temperature=0, max_tokens=20, stop=(f"t{stop_token} ",)),
            ),
            GenerationRequest(
                prompt,
                sampling=SamplingParams(temperature=0, max_tokens=20, stop=(f" t{stop_token}",)),
            ),
        ]
    )
    assert outputs[0].completions[0].token_ids == reference[:cut]
    assert outputs[0].completions[0].finish_reason == "stop"
    # " t{x} " needs the next token to be decoded: the completion ends one token later.
    assert outputs[1].completions[0].token_ids == reference[: cut + 1]
    assert outputs[2].completions[0].token_ids == reference[:cut]
    assert outputs[2].completions[0].finish_reason == "stop"

    model.generation_config.eos_token_id = stop_token
    engine = TorchEngine(model, max_num_seqs=4, max_model_len=64)
    eos, ignored = engine.generate(
        [
            GenerationRequest(prompt, sampling=SamplingParams(temperature=0, max_tokens=20)),
            GenerationRequest(
                prompt, sampling=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            ),
        ]
    )
    assert eos.completions[0].token_ids == reference[:cut]
    assert ignored.completions[0].token_ids == reference
    assert ignored.completions[0].finish_reason == "length"


def test_max_model_len_caps_the_completion() -> None:
    engine = TorchEngine(tiny_model("qwen2"), max_num_seqs=2, max_model_len=40)
    (output,) = engine.generate(
        [GenerationRequest(list(range(30)), sampling=SamplingParams(max_tokens=100))]
    )
    assert len(output.completions[0].token_ids) == 10
    assert output.completions[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(GenerationRequest(list(range(40))))


def test_weight_update_mid_generation_changes_tokens_and_versions() -> None:
    model, other = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    new_weights = {k: v.clone() for k, v in other.state_dict().items()}
    reference = tiny_model("qwen2", seed=0)
    engine = TorchEngine(model, max_num_seqs=4, max_model_len=96)
    prompts = make_prompts(2)
    sampling = SamplingParams(temperature=0, max_tokens=20)
    requests = [GenerationRequest(p, sampling=sampling) for p in prompts]
    for request in requests:
        engine.add_request(request)
    for _ in range(5):  # one token per step
        assert engine.step() == []
    engine.update_weights(new_weights, policy_version=1)
    late = GenerationRequest(prompts[0], sampling=SamplingParams(temperature=0, max_tokens=4))
    engine.add_request(late)
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    assert engine.policy_version == 1
    for prompt, request in zip(prompts, requests, strict=True):
        completion = outputs[request.request_id].completions[0]
        before = hf_greedy(reference, prompt, 5)
        # Running sequences keep their KV cache across the update (as PipelineRL does).
        after = greedy_after_update(reference, other, prompt, before, 15)
        assert completion.token_ids == before + after
        assert after != hf_greedy(reference, prompt, 20)[5:]
        assert completion.version_changes == ((0, 0), (5, 1))
        assert completion.policy_versions == [0] * 5 + [1] * 15
        assert completion.policy_version == 0
    late_out = outputs[late.request_id].completions[0]
    assert late_out.version_changes == ((0, 1),)
    assert late_out.token_ids == hf_greedy(other, prompts[0], 4)


def test_update_weights_rejects_unknown_names_and_shapes() -> None:
    engine = TorchEngine(tiny_model("qwen2"), max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights({"model.nope.weight": torch.zeros(1)}, policy_version=1)
    weight = engine.model.model.norm.weight
    before = weight.clone()
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(
            {"model.norm.weight": torch.zeros_like(weight), "lm_head.weight": torch.zeros(3)},
            policy_version=1,
        )
    assert torch.equal(weight, before) and engine.policy_version == 0  # nothing applied
    engine.update_weights([("model.norm.weight", torch.full_like(weight, 2.0))], policy_version=3)
    assert engine.model.model.norm.weight is weight  # copied in place, not replaced
    assert torch.all(weight == 2.0) and engine.policy_version == 3


def test_background_loop_applies_updates_from_another_thread() -> None:
    model = tiny_model("qwen2")
    state = {k: v.clone() for k, v in tiny_model("qwen2", seed=1).state_dict().items()}
    engine = TorchEngine(model, max_num_seqs=8, max_model_len=128)
    engine.start()
    try:
        sampling = SamplingParams(max_tokens=60, ignore_eos=True)
        futures = [
            engine.submit(GenerationRequest(p, n=2, sampling=sampling)) for p in make_prompts(6)
        ]

        def updater() -> None:
            for version in (1, 2, 3):
                time.sleep(0.02)
                engine.update_weights(state, policy_version=version)

        thread = threading.Thread(target=updater)
        thread.start()
        thread.join()
        outputs = [f.result(timeout=60) for f in futures]
    finally:
        engine.shutdown()
    assert engine.policy_version == 3
    completions = [c for o in outputs for c in o.completions]
    assert all(len(c.token_ids) == 60 and len(c.logprobs) == 60 for c in completions)
    assert any(len(c.version_changes) > 1 for c in completions)
    for c in completions:
        versions = c.policy_versions
        assert len(versions) == 60 and versions == sorted(versions)


def test_pause_resume_loses_no_request() -> None:
    engine = TorchEngine(tiny_model("qwen2"), max_num_seqs=4, max_model_len=128)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.start()
    try:
        futures = [engine.submit(GenerationRequest(p, sampling=sampling)) for p in make_prompts(6)]
        time.sleep(0.02)
        engine.pause()
        steps = engine._step_count
        futures += [
            engine.submit(GenerationRequest(p, sampling=sampling)) for p in make_prompts(2, seed=9)
        ]
        time.sleep(0.1)
        assert engine._step_count == steps  # nothing ran while paused
        assert engine.step() == []  # and a direct step() is a no-op too
        engine.resume()
        outputs = [f.result(timeout=60) for f in futures]
    finally:
        engine.shutdown()
    assert len(outputs) == 8
    assert all(len(o.completions[0].token_ids) == 40 for o in outputs)


def test_abort_running_and_waiting_requests() -> None:
    engine = TorchEngine(tiny_model("qwen2"), max_num_seqs=2, max_model_len=64)
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    running = GenerationRequest(make_prompts(1)[0], n=2, sampling=sampling)
    waiting = GenerationRequest(make_prompts(1, seed=3)[0], sampling=sampling)
    engine.add_request(running)
    engine.add_request(waiting)
    for _ in range(4):
        engine.step()
    engine.abort(running.request_id)
    engine.abort(waiting.request_id)
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {running.request_id, waiting.request_id}
    by_id = {o.request_id: o for o in outputs}
    assert [len(c.token_ids) for c in by_id[running.request_id].completions] == [4, 4]
    assert [c.finish_reason for c in by_id[running.request_id].completions] == ["abort"] * 2
    assert by_id[waiting.request_id].completions[0].token_ids == []
    assert not engine.has_unfinished()
    (after,) = engine.generate([GenerationRequest(make_prompts(1)[0], sampling=sampling)])
    assert len(after.completions[0].token_ids) == 30  # freed slots are reusable


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop() -> None:
    model = tiny_model("qwen2")
    prompt = make_prompts(1)[0]
    reference = hf_greedy(model, prompt, 8)
    engine = TorchEngine(model, max_num_seqs=2, max_model_len=64, tokenizer=_SpaceTokenizer())
    stop = f" t{reference[5]}"
    cut = next(i for i in range(1, 9) if stop in _SpaceTokenizer().decode(reference[:i]))
    sampling = SamplingParams(temperature=0, max_tokens=cut, stop=stop)  # a str is one string
    (output,) = engine.generate([GenerationRequest(prompt, n=2, sampling=sampling)])
    for completion in output.completions:
        assert completion.token_ids == reference[:cut]
        assert completion.finish_reason == "stop"  # as a stop token would; not "length"
    with pytest.raises(ValueError, match="empty string"):
        SamplingParams(stop=("",))


def test_duplicate_request_ids_are_rejected_while_running() -> None:
    engine = TorchEngine(tiny_model("qwen2"), max_num_seqs=2, max_model_len=32)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError, match="unique"):
        engine.generate([GenerationRequest([1, 2], request_id="a")] * 2)
    assert not engine.has_unfinished()  # nothing was queued
    engine.start()
    try:
        first = engine.submit(GenerationRequest([1, 2], sampling=sampling, request_id="a"))
        # Before: the duplicate reached the loop thread, whose assertion killed it.
        with pytest.raises(ValueError, match="duplicate request_id"):
            engine.add_request(GenerationRequest([3, 4], sampling=sampling, request_id="a"))
        assert len(first.result(timeout=30).completions[0].token_ids) == 5
        again = engine.submit(GenerationRequest([3, 4], sampling=sampling, request_id="a"))
        assert len(again.result(timeout=30).completions[0].token_ids) == 5  # reusable once done
    finally:
        engine.shutdown()


def test_generate_waits_instead_of_spinning_while_paused() -> None:
    engine = TorchEngine(tiny_model("qwen2"), max_num_seqs=4, max_model_len=64)
    calls = 0
    step = engine.step

    def counting_step() -> list:
        nonlocal calls
        calls += 1
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.pause()
    thread = threading.Thread(
        target=lambda: engine.generate(
            [GenerationRequest(p, sampling=sampling) for p in make_prompts(4)]
        )
    )
    thread.start()
    time.sleep(0.2)
    assert calls <= 1  # before: thousands of no-op steps, holding the step lock in a busy loop
    engine.resume()
    thread.join(timeout=60)
    assert not thread.is_alive() and not engine.has_unfinished()


def test_engine_settings_and_requests_are_validated() -> None:
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        TorchEngine(model, max_model_len=1)
    assert TorchEngine(model, max_num_seqs=1).max_model_len == 512  # the model's limit
    engine = TorchEngine(model, max_num_seqs=1, max_model_len=16)
    with pytest.raises(ValueError, match=r"prompt of 16 tokens .* max_model_len=16"):
        engine.add_request(GenerationRequest(list(range(16))))
    with pytest.raises(ValueError, match=r"token id 128 outside the vocabulary \[0, 128\)"):
        engine.add_request(GenerationRequest([1, 128]))
    model.generation_config.eos_token_id = 0  # id 0 is a valid eos (it was dropped as falsy)
    assert TorchEngine(model, max_num_seqs=1, max_model_len=16).eos_token_ids == (0,)


def test_fused_projections_follow_in_place_updates() -> None:
    model, other = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    engine = TorchEngine(model, max_num_seqs=2, max_model_len=64)
    prompt = make_prompts(1)[0]
    sampling = SamplingParams(temperature=0, max_tokens=12)
    # q/k/v and gate/up now live in one fused tensor per layer; the HF parameters are views of
    # it, so copying one of them by name (update_weights) or via load_state_dict reaches it.
    names = ["model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight"]
    before = model.get_parameter(names[0])
    engine.update_weights({n: other.get_parameter(n) for n in names}, policy_version=1)
    assert model.get_parameter(names[0]) is before
    reference = tiny_model("qwen2", seed=0)
    reference.load_state_dict({n: other.get_parameter(n) for n in names}, strict=False)
    (output,) = engine.generate([GenerationRequest(prompt, sampling=sampling)])
    assert output.completions[0].token_ids == hf_greedy(reference, prompt, 12)
    model.load_state_dict(other.state_dict())
    (output,) = engine.generate([GenerationRequest(prompt, sampling=sampling)])
    assert output.completions[0].token_ids == hf_greedy(other, prompt, 12)
    # A second engine on the same model reuses the fused tensors: updates reach both.
    second = TorchEngine(model, max_num_seqs=2, max_model_len=64)
    second.update_weights(tiny_model("qwen2", seed=0).state_dict(), policy_version=2)
    (output,) = engine.generate([GenerationRequest(prompt, sampling=sampling)])
    assert output.completions[0].token_ids == hf_greedy(tiny_model("qwen2", seed=0), prompt, 12)


class _WrappedLinear(torch.nn.Module):
    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_wrapped_projections_fall_back_to_the_hf_forward() -> None:
    model = tiny_model("qwen2")
    attn = model.model.layers[0].self_attn
    attn.v_proj = _WrappedLinear(attn.v_proj)  # as LoRA or quantization wrappers do
    engine = TorchEngine(model, max_num_seqs=2, max_model_len=64)
    assert engine.forward_impl == "hf"
    with pytest.raises(ValueError, match=r"nn\.Linear"):
        TorchEngine(model, max_num_seqs=2, max_model_len=64, forward="fused")
    prompt = make_prompts(1)[0]
    sampling = SamplingParams(temperature=0, max_tokens=8)
    (output,) = engine.generate([GenerationRequest(prompt, sampling=sampling)])
    assert output.completions[0].token_ids == hf_greedy(model, prompt, 8)


def test_version_changes_helper_and_completion_properties() -> None:
    log = [(0, 0), (3, 1), (10, 4)]
    assert version_changes_for(log, 0, 3) == ((0, 0),)
    assert version_changes_for(log, 1, 5) == ((0, 0), (2, 1))
    assert version_changes_for(log, 4, 20) == ((0, 1), (6, 4))
    c = Completion("r", 0, [1, 2, 3, 4], [0.0] * 4, "length", ((0, 2), (1, 3), (3, 5)))
    assert c.policy_versions == [2, 3, 3, 5]
    assert c.policy_version == 2


def test_backend_registry_is_lazy() -> None:
    assert engine_class("torch") is TorchEngine
    with pytest.raises(ValueError, match=r"rollout\.backend"):
        engine_class("tensorrt")
    assert "vllm" not in sys.modules
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.gpu
def test_cuda_bf16_engine_matches_hf() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny_model("qwen2").to("cuda", torch.bfloat16)
    engine = TorchEngine(model, max_num_seqs=8, max_model_len=96)
    prompts = make_prompts(6)
    sampling = SamplingParams(temperature=0, max_tokens=16)
    outputs = engine.generate([GenerationRequest(p, sampling=sampling) for p in prompts])
    agree = total = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.completions[0]
        with torch.inference_mode():
            ids = torch.tensor([prompt + completion.token_ids], device="cuda")
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        recomputed = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()
        assert (recomputed - torch.tensor(completion.logprobs)).abs().max() < 0.1  # bf16
        agree += (logits.argmax(-1).cpu() == torch.tensor(completion.token_ids)).sum().item()
        total += len(completion.token_ids)
    assert agree / total > 0.95  # bf16 kernels differ: near-ties may flip


@pytest.mark.gpu
def test_vllm_engine_generates_and_updates_weights(tmp_path) -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    engine = engine_class("vllm")(
        str(tmp_path), max_model_len=128, gpu_memory_utilization=0.3, skip_tokenizer_init=True
    )
    sampling = SamplingParams(temperature=0, max_tokens=8)
    (output,) = engine.generate([GenerationRequest(make_prompts(1)[0], n=2, sampling=sampling)])
    assert [len(c.token_ids) for c in output.completions] == [8, 8]
    assert all(len(c.logprobs) == 8 for c in output.completions)
    assert output.completions[0].token_ids == hf_greedy(model, make_prompts(1)[0], 8)
    engine.update_weights(tiny_model("qwen2", seed=1).state_dict(), policy_version=1)
    (after,) = engine.generate([GenerationRequest(make_prompts(1)[0], sampling=sampling)])
    assert after.completions[0].version_changes == ((0, 1),)


def penalised_logits(logits: torch.Tensor, seen: list[list[int]], penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty by hand: row t's logits of the tokens in seen[t] divided by
    `penalty` where positive, multiplied where negative."""
    out = logits.clone()
    for row, tokens in zip(out, seen, strict=True):
        index = torch.tensor(sorted(set(tokens)))
        values = row[index]
        row[index] = torch.where(values > 0, values / penalty, values * penalty)
    return out


@pytest.mark.parametrize("penalty", [0.4, 3.0])
def test_repetition_penalty_distribution_and_logprobs_match_a_hand_computation(
    penalty: float,
) -> None:
    model = tiny_model("qwen2")
    # A prompt ending in the model's greedy continuation holds tokens it likes to repeat.
    base = make_prompts(4)[3]
    prompt = base + hf_greedy(model, base, 8)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1:].float()
    raw = logits.div(0.8).softmax(-1)[0]
    expected = penalised_logits(logits, [prompt], penalty).div(0.8).softmax(-1)[0]
    assert 0.5 * (raw - expected).abs().sum() > 0.15  # the penalty matters for this prompt
    engine = TorchEngine(model, max_num_seqs=256, max_model_len=32, seed=7)
    sampling = SamplingParams(temperature=0.8, max_tokens=1, repetition_penalty=penalty)
    (output,) = engine.generate([GenerationRequest(prompt, n=4000, sampling=sampling)])
    tokens = torch.tensor([c.token_ids[0] for c in output.completions])
    empirical = torch.bincount(tokens, minlength=128).float() / len(tokens)
    assert 0.5 * (empirical - expected).abs().sum() < 0.08
    logprobs = torch.tensor([c.logprobs[0] for c in output.completions])
    assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-4)


def test_repetition_penalty_counts_the_completion_so_far_and_mixes_with_plain_requests() -> None:
    """Each token's log-prob is that of the distribution penalised by the prompt and the tokens
    sampled before it; a request without a penalty in the same batch is unaffected."""
    model = tiny_model("qwen2")
    engine = TorchEngine(model, max_num_seqs=16, max_model_len=64)
    prompts = make_prompts(3)
    penalised = SamplingParams(temperature=1.0, top_k=40, max_tokens=12, repetition_penalty=1.8)
    plain = SamplingParams(temperature=1.0, top_k=40, max_tokens=12, seed=5)
    requests = [GenerationRequest(p, n=2, sampling=penalised) for p in prompts]
    requests.append(GenerationRequest(prompts[0], n=2, sampling=plain))
    outputs = engine.generate(requests)
    greedy = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8)
    (greedy_out,) = engine.generate([GenerationRequest(prompts[1], sampling=greedy)])
    for output, sampling in [(o, penalised) for o in outputs[:3]] + [(greedy_out, greedy)]:
        prompt = list(output.prompt_token_ids)
        for completion in output.completions:
            tokens = completion.token_ids
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            seen = [prompt + tokens[:t] for t in range(len(tokens))]
            logits = penalised_logits(logits.float(), seen, sampling.repetition_penalty)
            if sampling.temperature == 0:
                assert tokens == logits.argmax(-1).tolist()
            else:
                kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            expected = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    # The plain request samples as it would alone (it is seeded: independent of the batch).
    alone = TorchEngine(model, max_num_seqs=16, max_model_len=64).generate([requests[-1]])
    assert [c.token_ids for c in alone[0].completions] == [
        c.token_ids for c in outputs[-1].completions
    ]
