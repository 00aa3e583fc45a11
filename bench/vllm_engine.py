"""vLLM as the rollout engine against the built-in engine and Hugging Face `generate`, in one run.

Run in .venv-vllm (`make setup-vllm`): `.venv-vllm/bin/python bench/vllm_engine.py`.

1. Decode on the GSM8K shape on CPU (as bench/engine.py): `tiny:qwen2_gsm8k` (14.2M parameters,
   random weights, fp32), the first `--prompts` GSM8K questions under the chat template, n = 8
   samples each, exactly `--new-tokens` tokens per sample at T = 1. Tokens per wall second of
   vLLM (through nebula-rl's `VLLMEngine`: one request per sample, the prompt shared through the
   prefix cache), of the built-in `TorchEngine`, and of `model.generate`.
2. A weight update into vLLM as a rollout replica takes it: the whole model written into the
   staging copy, then loaded into vLLM's worker (`load_named_weights`), between two decode steps;
   seconds per GB of weights, against a plain `copy_` of the same bytes into a warm buffer.

SUMMARY lines: `vllm_vs_hf_generate_gsm8k_shape_cpu` (goal 1x), `vllm_vs_torch_engine_gsm8k_shape_cpu`
(no goal: 0x, reported), `vllm_update_vs_memcpy` (memcpy time / update time; goal 0.1x).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from engine import (  # bench/engine.py (this folder is on sys.path)
    gsm8k_prompts,
    left_pad,
    run_generate,
)
from nebula_rl.models import load_model, load_tokenizer
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.torch_engine import TorchEngine


def decode_rate(engine, prompts: list[list[int]], n: int, new_tokens: int) -> float:
    """Generated tokens per wall second of `engine` on all prompts at once."""
    sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outputs = engine.generate([GenerationRequest(p, n=n, sampling=sampling) for p in prompts])
    seconds = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.completions)
    assert num_tokens == len(prompts) * n * new_tokens
    return num_tokens / seconds


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `run`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def update_seconds(engine, staging: torch.nn.Module, source: torch.nn.Module, repeats: int):
    """Median seconds of a whole-model update into vLLM (staging written, then loaded)."""

    def write() -> int:
        with torch.no_grad():
            for p, q in zip(staging.parameters(), source.parameters(), strict=True):
                p.copy_(q)
        return engine.policy_version + 1

    return median_seconds(lambda: engine.update_weights_with(write), repeats)


def memcpy_seconds(num_bytes: int, repeats: int) -> float:
    """Median seconds of a `copy_` of `num_bytes` into a warm buffer."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # (warm)
    return median_seconds(lambda: dst.copy_(src), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="GSM8K prompts")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per sample")
    parser.add_argument("--repeats", type=int, default=5, help="weight updates timed")
    args = parser.parse_args()
    torch.manual_seed(0)
    from nebula_rl.rollout.vllm_engine import VLLMEngine

    tokenizer = load_tokenizer("tiny:qwen2_gsm8k")
    prompts = gsm8k_prompts(tokenizer, args.prompts)
    n = 8
    model = load_model("tiny:qwen2_gsm8k", dtype=torch.float32, seed=0).eval()
    max_len = max(len(p) for p in prompts) + args.new_tokens
    folder = tempfile.mkdtemp(prefix="bench-vllm-")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    staging = load_model(folder, dtype=torch.float32).eval()
    print(
        f"== GSM8K shape, CPU: tiny:qwen2_gsm8k (random weights, fp32), {len(prompts)} prompts x "
        f"n = {n}, {args.new_tokens} new tokens each, T = 1; torch threads "
        f"{torch.get_num_threads()}"
    )
    vllm = VLLMEngine(
        folder, staging=staging, dtype="float32", device="cpu", max_model_len=max_len + 8,
        seed=0, enforce_eager=True, max_num_seqs=len(prompts) * n, enable_chunked_prefill=False,
        max_num_batched_tokens=8192,
    )  # fmt: skip
    decode_rate(vllm, prompts[:2], n, 8)  # (warm)
    vllm_rate = decode_rate(vllm, prompts, n, args.new_tokens)
    torch_engine = TorchEngine(model, max_num_seqs=len(prompts) * n, max_model_len=max_len)
    decode_rate(torch_engine, prompts[:2], n, 8)
    torch_rate = decode_rate(torch_engine, prompts, n, args.new_tokens)
    ids, mask = left_pad(prompts, "cpu")
    sampling = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)
    generate_rate = run_generate(model, ids, mask, args.new_tokens, sampling, "cpu", n=n)
    print(
        f"decode tokens/s: vLLM {vllm_rate:.0f}, built-in engine {torch_rate:.0f}, "
        f"HF generate {generate_rate:.0f}"
    )
    num_bytes = sum(p.numel() * p.element_size() for p in staging.parameters())
    source = load_model("tiny:qwen2_gsm8k", dtype=torch.float32, seed=1)
    update = update_seconds(vllm, staging, source, args.repeats)
    memcpy = memcpy_seconds(num_bytes, args.repeats)
    gb = num_bytes / 1e9
    print(
        f"weight update into vLLM: {update * 1e3:.1f} ms for {gb * 1e3:.1f} MB "
        f"({update / gb:.2f} s/GB; a copy_ of the same bytes {memcpy * 1e3:.2f} ms, "
        f"{memcpy / gb:.3f} s/GB)"
    )
    print(f"SUMMARY vllm_vs_hf_generate_gsm8k_shape_cpu {vllm_rate / generate_rate:.2f}x goal 1x")
    print(f"SUMMARY vllm_vs_torch_engine_gsm8k_shape_cpu {vllm_rate / torch_rate:.2f}x goal 0x")
    print(f"SUMMARY vllm_update_vs_memcpy {memcpy / update:.2f}x goal 0.1x")


if __name__ == "__main__":
    main()
