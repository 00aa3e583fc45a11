"""The built-in engine on a GPU: tokens/s against Hugging Face `generate` and against the HBM bound.

Model: a Qwen2.5-0.5B-shaped Qwen2 (random weights, built from its config: no download), bf16.
Workload, GSM8K-like: `--prompts` random-token prompts of ~`--prompt-len` tokens, `--n` samples
each (`--batch` = prompts x n sequences decoded together), exactly `--new-tokens` new tokens per
sequence (the engine with `ignore_eos`, `generate` with `min_new_tokens = max_new_tokens`),
sampled at `--temperature` with `--top-k` (0 = off) on both sides. Rows:

1. `TorchEngine(model, max_num_seqs=batch).generate(...)`: one request of n samples per prompt
   (so each prompt is prefilled once and its KV blocks are shared by its samples);
2. `model.generate` on the same prompts, left-padded, every prompt repeated n times (one batch of
   `batch` rows, the default dynamic cache);
3. with `--quantization fp8`, the engine again with `quantization="fp8"` (decoder-layer matmuls in
   FP8), when this checkout's `TorchEngine` takes that argument (else the row is skipped, saying so).

Each row: one warm-up run of `--warmup-tokens` tokens, `--repeats` runs of 1 token (the prefill:
prompt forward + first token), then `--repeats` full runs, synchronized around; figures are the
fastest of the repeats (a first full-length run can be far slower than the next: HF generate's
took 24.9 s, then 6.0 s, on an H200 on 2026-11-26; the engine's 7.2 s, then 6.9 s). Decode alone = full run - prefill run, over the `new_tokens - 1` tokens after the first.

The HBM bound. A decode step of B sequences has to read every weight once (parameter bytes, the
tied embedding counted once: it is the LM head's read; the embedding gather is negligible) and
the keys and values of every running sequence: 2 x layers x kv_heads x head_dim x 2 bytes per
cached token. A run of T new tokens is T forward passes; pass s (0 = the prefill) reads the
weights plus the KV of prompt_len_i + s tokens of each sequence i. Bound time = those bytes /
bandwidth, with the bandwidth MEASURED here: a `--copy-mib` device-to-device `copy_`, bytes
read + written, median of 10 (CUDA events; on CPU, a host memcpy timed by the wall clock). The
fraction reported is bound time / measured time (1.0 = at the bandwidth limit); for the whole run
the prefill counts as one pass (it is compute-bound really: the fraction is a lower estimate),
for decode alone passes 1..T-1 against the decode time. Also printed: the bound when a prompt's
KV is read once per group, as the engine's attention does (`generate` reads it per row), and the
FP8 row's weights at 1 byte (+ an fp32 scale per output feature) for the decoder layers' linear
weights, the rest (embedding / LM head, norms, biases) in bf16.

Run on a GPU (under ~90 s on an H100: model build ~5 s, each row ~10-20 s):

    .venv/bin/python bench/gpu_engine.py --quantization fp8 --json outputs/bench/gpu_engine.json

CPU smoke run (tiny model of the same architecture, a few seconds; the bound uses a CPU copy):

    .venv/bin/python bench/gpu_engine.py --device cpu --shape tiny --batch 16 --prompts 2 \
        --n 8 --new-tokens 16

Without CUDA and without `--device`, it prints that and exits 0 (`make bench` runs every script
with its defaults). Ends with `SUMMARY <name> <ratio>x [goal <goal>x]` lines.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers

from engine import left_pad  # bench/engine.py (this folder is on sys.path when run as a script)
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.torch_engine import TorchEngine

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's architecture (max_position_embeddings cut to 4096: nothing here is longer).
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
DATASHEET_TB_S = {"H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H200": 4.8}
"""HBM bandwidth from the datasheets, by a part of the device name (for reference only)."""
MARGIN = 8
"""Tokens of max_model_len beyond the longest prompt + new tokens."""
GOAL_VS_GENERATE = 3.0
"""Engine / generate tokens per second (issue 18's goal, as in bench/engine.py)."""


def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    """A Qwen2 model of `shape` with random weights (seed 0), bf16, built on `device`."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def make_prompts(num: int, length: int, spread: int, vocab: int) -> list[list[int]]:
    """`num` prompts of random token ids, lengths uniform in length +- spread (seed 1)."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(length - spread, length + spread + 1, (num,), generator=generator)
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 10) -> float:
    """Bytes per second of `dst.copy_(src)` on `device` (read + written), median of `repeats`."""
    src = torch.ones(mib << 19, dtype=torch.bfloat16, device=device)  # 2 bytes an element
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - begin)
    return 2 * src.numel() * src.element_size() / statistics.median(seconds)


def weight_bytes(model: torch.nn.Module, *, fp8: bool = False) -> int:
    """Bytes of the parameters (a tied tensor once). With `fp8`: the decoder layers' linear
    weights at 1 byte plus an fp32 scale per output feature, the rest as stored."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not fp8:
        return total
    for module in model.get_submodule("model.layers").modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            total -= weight.numel() * (weight.element_size() - 1)
            total += 4 * weight.shape[0]
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of one token's keys and values over all layers (cache in the model's dtype)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes


def bound_bytes(
    weights: int,
    kv_per_token: int,
    prompt_lens: list[int],
    n: int,
    passes: range,
    *,
    shared_prompt: bool = False,
) -> int:
    """Bytes that forward passes `passes` (0 = prefill) must read: the weights, plus the KV of
    prompt_len + s tokens of each of the len(prompt_lens) x n sequences at pass s. With
    `shared_prompt`, a prompt's KV is read once for its n samples."""
    batch = len(prompt_lens) * n
    prompt_tokens = sum(prompt_lens) * (1 if shared_prompt else n)
    return sum(weights + kv_per_token * (prompt_tokens + batch * s) for s in passes)


def measure(
    run: Callable[[int], int],
    *,
    batch: int,
    new_tokens: int,
    warmup_tokens: int,
    repeats: int,
    device: torch.device,
) -> dict[str, Any]:
    """Time `run(max_tokens) -> tokens generated`: warm-up, prefill-only runs, full runs; the
    peak memory (CUDA only, else None) is that of the full runs."""

    def timed(max_tokens: int) -> float:
        sync(device)
        start = time.perf_counter()
        num_tokens = run(max_tokens)
        sync(device)
        elapsed = time.perf_counter() - start
        assert num_tokens == batch * max_tokens, (num_tokens, batch, max_tokens)
        return elapsed

    timed(warmup_tokens)
    prefill = min(timed(1) for _ in range(repeats))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    walls = [timed(new_tokens) for _ in range(repeats)]
    wall = min(walls)
    print(
        f"  prefill (1 token) {prefill:.3f} s; full runs " + ", ".join(f"{w:.2f} s" for w in walls),
        flush=True,
    )
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "wall_s": wall,
        "walls_s": walls,
        "prefill_s": prefill,
        "decode_s": wall - prefill,
        "tokens": batch * new_tokens,
        "tokens_per_s": batch * new_tokens / wall,
        "decode_tokens_per_s": batch * (new_tokens - 1) / (wall - prefill),
        "peak_gib": None if peak is None else peak / 2**30,
    }


def engine_runner(
    engine: TorchEngine, prompts: list[list[int]], n: int, sampling: SamplingParams
) -> Callable[[int], int]:
    """`run(max_tokens)` for the engine: one request of `n` samples per prompt."""

    def run(max_tokens: int) -> int:
        params = replace(sampling, max_tokens=max_tokens)
        outputs = engine.generate([GenerationRequest(p, n=n, sampling=params) for p in prompts])
        return sum(len(c.token_ids) for o in outputs for c in o.completions)

    return run


def generate_runner(
    model: torch.nn.Module, prompts: list[list[int]], n: int, sampling: SamplingParams
) -> Callable[[int], int]:
    """`run(max_tokens)` for HF generate: one left-padded batch, each prompt repeated n times."""
    ids, mask = left_pad(prompts, next(model.parameters()).device)
    ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
    greedy = sampling.temperature == 0
    options: dict[str, Any] = (
        {"do_sample": False}
        if greedy
        else {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": 1.0,
        }
    )

    def run(max_tokens: int) -> int:
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
                **options,
            )
        assert out.shape == (ids.shape[0], ids.shape[1] + max_tokens), out.shape
        return out.shape[0] * max_tokens

    return run


def release(device: torch.device) -> None:
    """Free what the last row left (its engine's KV cache) before the next row's peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=256, help="sequences decoded together")
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=150, help="mean prompt length")
    parser.add_argument("--prompt-spread", type=int, default=20, help="prompt length +- this")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up run")
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed runs per row (the fastest counts)"
    )
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none")
    parser.add_argument("--copy-mib", type=int, default=None, help="bandwidth copy size")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    args = parser.parse_args()
    if args.batch != args.prompts * args.n:
        parser.error(f"--batch {args.batch} must equal --prompts x --n = {args.prompts * args.n}")
    if args.device is None:
        if not torch.cuda.is_available():
            print("no CUDA device: nothing measured (a CPU smoke run: --device cpu --shape tiny)")
            return
        args.device = "cuda"
    device = torch.device(args.device)
    if args.copy_mib is None:
        args.copy_mib = 2048 if device.type == "cuda" else 256

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"device {name}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} CPU threads",
        flush=True,
    )
    bandwidth = copy_bandwidth(device, args.copy_mib)
    release(device)
    datasheet = next((tb for part, tb in DATASHEET_TB_S.items() if part in name), None)
    print(
        f"measured {'device-to-device' if device.type == 'cuda' else 'host (CPU) memcpy'} "
        f"bandwidth: {bandwidth / 1e12:.2f} TB/s ({args.copy_mib} MiB copy_, read + written)"
        + (f"; datasheet {datasheet} TB/s" if datasheet else ""),
        flush=True,
    )

    start = time.perf_counter()
    model = build_model(args.shape, device)
    sync(device)
    build_s = time.perf_counter() - start
    prompts = make_prompts(
        args.prompts, args.prompt_len, args.prompt_spread, model.config.vocab_size
    )
    prompt_lens = [len(p) for p in prompts]
    weights = weight_bytes(model)
    kv_token = kv_bytes_per_token(model)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.shape} (Qwen2, random weights, bf16): {num_params / 1e6:.1f}M parameters, "
        f"{weights / 1e9:.3f} GB, KV {kv_token} bytes a token; built in {build_s:.1f} s",
        flush=True,
    )
    print(
        f"workload: {args.prompts} prompts x n = {args.n} = batch {args.batch}, prompts "
        f"{min(prompt_lens)}-{max(prompt_lens)} tokens (mean {statistics.mean(prompt_lens):.0f}), "
        f"{args.new_tokens} new tokens each, T = {args.temperature}, top-k {args.top_k}",
        flush=True,
    )
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        max_tokens=args.new_tokens,
        ignore_eos=True,
    )
    max_model_len = max(prompt_lens) + args.new_tokens + MARGIN
    timing = dict(
        batch=args.batch,
        new_tokens=args.new_tokens,
        warmup_tokens=args.warmup_tokens,
        repeats=args.repeats,
        device=device,
    )

    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    print("\nrow: HF generate", flush=True)
    rows["hf_generate"] = measure(generate_runner(model, prompts, args.n, sampling), **timing)
    release(device)
    print("row: engine bf16", flush=True)
    engine = TorchEngine(model, max_num_seqs=args.batch, max_model_len=max_model_len)
    rows["engine"] = measure(engine_runner(engine, prompts, args.n, sampling), **timing)
    del engine
    release(device)
    if args.quantization == "fp8":
        if "quantization" in inspect.signature(TorchEngine.__init__).parameters:
            print("row: engine fp8", flush=True)
            engine = TorchEngine(
                model, max_num_seqs=args.batch, max_model_len=max_model_len, quantization="fp8"
            )
            rows["engine_fp8"] = measure(engine_runner(engine, prompts, args.n, sampling), **timing)
            del engine
            release(device)
        else:
            skipped["engine_fp8"] = "TorchEngine.__init__ takes no `quantization` argument here"
            print(f"row engine fp8 skipped: {skipped['engine_fp8']}", flush=True)

    new = args.new_tokens
    for key, row in rows.items():
        row_weights = weight_bytes(model, fp8=key == "engine_fp8")
        total = bound_bytes(row_weights, kv_token, prompt_lens, args.n, range(new))
        decode = bound_bytes(row_weights, kv_token, prompt_lens, args.n, range(1, new))
        shared = bound_bytes(
            row_weights, kv_token, prompt_lens, args.n, range(new), shared_prompt=True
        )
        row["weight_bytes"] = row_weights
        row["bound_bytes"] = total
        row["bound_s"] = total / bandwidth
        row["hbm_fraction"] = row["bound_s"] / row["wall_s"]
        row["decode_bound_s"] = decode / bandwidth
        row["decode_hbm_fraction"] = row["decode_bound_s"] / row["decode_s"]
        row["bound_shared_prompt_s"] = shared / bandwidth
        row["hbm_fraction_shared_prompt"] = row["bound_shared_prompt_s"] / row["wall_s"]

    print(
        f"\n{'row':<12} {'wall s':>7} {'tok/s':>9} {'prefill s':>9} {'decode tok/s':>12} "
        f"{'bound s':>8} {'HBM frac':>8} {'decode frac':>11} {'peak GiB':>8}"
    )
    for key, row in rows.items():
        print(
            f"{key:<12} {row['wall_s']:7.2f} {row['tokens_per_s']:9.0f} {row['prefill_s']:9.3f} "
            f"{row['decode_tokens_per_s']:12.0f} {row['bound_s']:8.3f} {row['hbm_fraction']:8.3f} "
            f"{row['decode_hbm_fraction']:11.3f} "
            + ("       -" if row["peak_gib"] is None else f"{row['peak_gib']:8.2f}")
        )
    print(
        f"(bound: weights + every sequence's KV read once per forward pass, at the measured "
        f"{bandwidth / 1e12:.2f} TB/s; reading each prompt's KV once per group instead: "
        + ", ".join(
            f"{key} {row['bound_shared_prompt_s']:.3f} s = {row['hbm_fraction_shared_prompt']:.3f}"
            for key, row in rows.items()
        )
        + ")"
    )

    label = (
        f"batch {args.batch}, {args.prompts} prompts x n {args.n}, {args.new_tokens} new tokens, "
        f"bf16, {args.shape}, {name}"
    )
    hf, eng = rows["hf_generate"], rows["engine"]
    summary = [
        f"gpu_engine_vs_hf_generate {eng['tokens_per_s'] / hf['tokens_per_s']:.2f}x goal "
        f"{GOAL_VS_GENERATE:g}x (tokens/s {eng['tokens_per_s']:.0f} vs "
        f"{hf['tokens_per_s']:.0f}, {label})",
        f"gpu_engine_hbm_fraction {eng['hbm_fraction']:.2f}x (no goal; decode alone "
        f"{eng['decode_hbm_fraction']:.2f}, at {bandwidth / 1e12:.2f} TB/s measured)",
        f"gpu_hf_generate_hbm_fraction {hf['hbm_fraction']:.2f}x (no goal; decode alone "
        f"{hf['decode_hbm_fraction']:.2f})",
    ]
    if "engine_fp8" in rows:
        fp8 = rows["engine_fp8"]
        summary += [
            f"gpu_engine_fp8_vs_hf_generate {fp8['tokens_per_s'] / hf['tokens_per_s']:.2f}x "
            f"(no goal; tokens/s {fp8['tokens_per_s']:.0f}; {fp8['tokens_per_s'] / eng['tokens_per_s']:.2f}x "
            f"the bf16 engine)",
            f"gpu_engine_fp8_hbm_fraction {fp8['hbm_fraction']:.2f}x (no goal; FP8 decoder "
            f"weights in the bound)",
        ]
    print()
    for line in summary:
        print(f"SUMMARY {line}")

    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "device": name,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "argv": sys.argv[1:],
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "num_params": num_params,
            "weight_bytes": weights,
            "kv_bytes_per_token": kv_token,
            "prompt_lens": prompt_lens,
            "build_s": build_s,
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_kind": "cuda copy_" if device.type == "cuda" else "cpu memcpy",
            "datasheet_tb_per_s": datasheet,
            "rows": rows,
            "skipped": skipped,
            "summary": summary,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
