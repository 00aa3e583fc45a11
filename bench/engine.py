"""Benchmark the built-in generation engine against Hugging Face `generate`, in one process.

What it measures, each time on the same model, prompts and sampling:

1. Decode throughput (generated tokens / wall second) of `TorchEngine` and of `model.generate`
   (left-padded batch, do_sample, same temperature/top-k, exactly `--new-tokens` tokens each).
   The two are run interleaved, round after round, and the ratio reported is the median of the
   per-round ratios: on a shared machine, neighbours' load hits both sides of a round alike.
   On CPU: the tiny Qwen2-architecture model, batch 64, 128 new tokens, fp32 and bf16. With CUDA:
   a Qwen2.5-0.5B-architecture model (random weights), bf16, batch 256, and tokens/s against the
   memory-bandwidth bound (weights + KV cache read once per step, at the measured copy bandwidth).
2. Weight-update latency in the middle of generation: from another thread, pause -> load a full
   state dict -> resume, while the engine loop runs; compared with a plain `load_state_dict`.
3. Log-prob mismatch: the engine's per-token log-probs against the policy's recomputation (one
   teacher-forced forward of prompt + completion, same temperature and top-k).

Ends with the log-prob mismatch and one `SUMMARY <name> <ratio>x goal <goal>x` line per goal
(decode throughput: engine / generate, higher is better; weight update: mid-generation latency /
load_state_dict, lower is better).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from nebula_rl.data import prompt_token_ids
from nebula_rl.models import build_tiny_model, load_model, load_tokenizer
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.torch_engine import TorchEngine

PROMPT_LENGTHS = (8, 16, 24, 32)


def tiny_qwen2(dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The tiny Qwen2-architecture model of the tests (random init, ~3M parameters)."""
    return build_tiny_model("qwen2", vocab_size=128, seed=0).to(device, dtype).eval()


def qwen25_05b(dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A Qwen2.5-0.5B-architecture model with random weights."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def make_prompts(batch: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(
            0, vocab, (PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)],), generator=generator
        ).tolist()
        for i in range(batch)
    ]


def left_pad(
    prompts: list[list[int]], device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `prompts`, left-padded with 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_generate(
    model, ids, mask, new_tokens: int, sampling: SamplingParams, device: str, n: int = 1
) -> float:
    """Tokens/s of HF generate for one batch (`n` sequences per prompt)."""
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=1.0,
            num_return_sequences=n,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            use_cache=True,
            pad_token_id=0,
        )
    sync(device)
    elapsed = time.perf_counter() - start
    assert out.shape == (ids.shape[0] * n, ids.shape[1] + new_tokens)
    return out.shape[0] * new_tokens / elapsed


def run_engine(engine: TorchEngine, prompts, sampling: SamplingParams, device: str) -> float:
    """Tokens/s of the engine for one batch."""
    sync(device)
    start = time.perf_counter()
    outputs = engine.generate([GenerationRequest(p, sampling=sampling) for p in prompts])
    sync(device)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.completions)
    assert num_tokens == len(prompts) * sampling.max_tokens
    return num_tokens / elapsed


def decode_ratio(
    model, prompts, new_tokens: int, rounds: int, device: str, label: str, max_model_len: int
) -> float:
    """Interleaved rounds of generate vs engine; prints per-round figures; returns median ratio."""
    sampling = SamplingParams(temperature=1.0, top_k=50, max_tokens=new_tokens, ignore_eos=True)
    engine = TorchEngine(model, max_num_seqs=len(prompts), max_model_len=max_model_len)
    ids, mask = left_pad(prompts, device)
    # Warm-up over the full length: kernels/primitives for every attention length get built once.
    run_generate(model, ids, mask, new_tokens, sampling, device)
    run_engine(engine, prompts, sampling, device)
    ratios, hf_rates, engine_rates = [], [], []
    for round_index in range(rounds):
        hf = run_generate(model, ids, mask, new_tokens, sampling, device)
        eng = run_engine(engine, prompts, sampling, device)
        hf_rates.append(hf)
        engine_rates.append(eng)
        ratios.append(eng / hf)
        print(
            f"  [{label}] round {round_index}: generate {hf:8.0f} tok/s   engine {eng:8.0f} tok/s"
            f"   ratio {eng / hf:5.2f}x"
        )
    ratio = statistics.median(ratios)
    print(
        f"  [{label}] median: generate {statistics.median(hf_rates):.0f} tok/s, engine "
        f"{statistics.median(engine_rates):.0f} tok/s, ratio {ratio:.2f}x "
        f"(best vs best {max(engine_rates) / max(hf_rates):.2f}x)"
    )
    return ratio


def weight_update_latency(model, prompts, device: str, repeats: int = 5) -> dict[str, float]:
    """Median seconds of: a plain load_state_dict; update_weights while paused (the copy alone);
    pause -> update_weights -> resume from another thread while the engine loop generates."""
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def timed(fn) -> float:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    with torch.no_grad():
        load = statistics.median(
            timed(lambda: model.load_state_dict(state)) for _ in range(repeats)
        )
    engine = TorchEngine(model, max_num_seqs=len(prompts), max_model_len=512)
    sampling = SamplingParams(max_tokens=400, ignore_eos=True)
    engine.start()
    futures = [engine.submit(GenerationRequest(p, sampling=sampling)) for p in prompts]
    mid_run, copy_only = [], []
    try:
        for version in range(1, repeats + 1):
            time.sleep(0.05)  # let it generate

            def pause_update_resume(v: int = version) -> None:
                engine.pause()
                engine.update_weights(state, policy_version=v)
                engine.resume()

            mid_run.append(timed(pause_update_resume))
        engine.pause()
        for version in range(repeats):
            copy_only.append(
                timed(lambda v=version: engine.update_weights(state, policy_version=100 + v))
            )
        engine.resume()
        outputs = [f.result() for f in futures]
    finally:
        engine.shutdown()
    spans = sum(len(c.version_changes) > 1 for o in outputs for c in o.completions)
    print(f"  completions spanning a weight update: {spans}/{len(outputs)}")
    return {
        "load_state_dict": load,
        "copy": statistics.median(copy_only),
        "mid_run": statistics.median(mid_run),
    }


def logprob_mismatch(model, prompts, device: str, label: str) -> float:
    """Engine log-probs vs the policy's teacher-forced recomputation of the same tokens."""
    sampling = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True)
    engine = TorchEngine(model, max_num_seqs=len(prompts), max_model_len=256)
    outputs = engine.generate([GenerationRequest(p, sampling=sampling) for p in prompts])
    diffs = []
    with torch.inference_mode():
        for out in outputs:
            completion = out.completions[0]
            ids = torch.tensor([list(out.prompt_token_ids) + completion.token_ids], device=device)
            logits = model(ids).logits[0, len(out.prompt_token_ids) - 1 : -1].float()
            recomputed = (
                (logits / sampling.temperature)
                .log_softmax(-1)
                .gather(1, ids[0, len(out.prompt_token_ids) :, None])[:, 0]
            )
            diffs.append((recomputed.cpu() - torch.tensor(completion.logprobs)).abs())
    diff = torch.cat(diffs)
    print(
        f"  [{label}] log-prob |engine - policy recompute|: max {diff.max():.2e}, "
        f"mean {diff.mean():.2e} over {diff.numel()} tokens"
    )
    return diff.max().item()


GSM8K_SYSTEM = "Solve the problem step by step, then give the final number after '####'."


def gsm8k_prompts(tokenizer, num: int) -> list[list[int]]:
    """The first `num` GSM8K training questions under the chat template, as the GSM8K-shaped
    job builds them (configs/bench_gsm8k.toml)."""
    with open("data/gsm8k/train.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(num), f, strict=False)]
    return [
        prompt_token_ids(tokenizer, row["question"], system_prompt=GSM8K_SYSTEM) for row in rows
    ]


def gsm8k_engine_vs_generate(
    model, prompts: list[list[int]], n: int, new_tokens: int
) -> tuple[float, float, float]:
    """One timed run each of the engine (requests of n samples) and HF generate
    (num_return_sequences = n, left-padded), sampling at T=1 exactly `new_tokens` tokens per
    sample. Returns (engine tokens/s, generate tokens/s, the engine's peak KV memory over
    full-length slots for the same sequences)."""
    max_len = max(len(p) for p in prompts) + new_tokens
    engine = TorchEngine(model, max_num_seqs=len(prompts) * n, max_model_len=max_len)
    sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(GenerationRequest(p, n=n, sampling=sampling))
    peak, num_tokens = 0, 0
    while engine.has_unfinished():
        outputs = engine.step()
        num_tokens += sum(len(c.token_ids) for o in outputs for c in o.completions)
        peak = max(peak, engine.kv_cache_usage[0])
    engine_rate = num_tokens / (time.perf_counter() - start)
    assert num_tokens == len(prompts) * n * new_tokens
    slots = len(prompts) * n * -(-max_len // engine.block_size)
    ids, mask = left_pad(prompts, "cpu")
    generate_rate = run_generate(model, ids, mask, new_tokens, sampling, "cpu", n=n)
    return engine_rate, generate_rate, peak / slots


def gsm8k_greedy_identical(model, prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """Prompts whose greedy tokens are the same from the engine and from HF generate."""
    engine = TorchEngine(model, max_num_seqs=len(prompts), max_model_len=512)
    sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = engine.generate([GenerationRequest(p, sampling=sampling) for p in prompts])
    same = 0
    with torch.inference_mode():
        for p, o in zip(prompts, outputs, strict=True):
            ids = torch.tensor([p])
            ref = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            same += ref == o.completions[0].token_ids
    return same, len(prompts)


def memory_bound_tokens_per_s(model, batch: int, avg_context: float) -> float:
    """Tokens/s if each decode step only read the weights and the KV cache once, at the
    device-to-device copy bandwidth measured here."""
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(buf)
    out.copy_(buf)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        out.copy_(buf)
    torch.cuda.synchronize()
    bandwidth = 2 * 10 * buf.numel() / (time.perf_counter() - start)  # read + write
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = (
        batch * avg_context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    )
    print(
        f"  measured copy bandwidth {bandwidth / 1e12:.2f} TB/s; bytes per step: weights "
        f"{weight_bytes / 1e9:.2f} GB + KV {kv_bytes / 1e9:.2f} GB"
    )
    return batch * bandwidth / (weight_bytes + kv_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--batch", type=int, default=64, help="CPU batch size")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--gpu-batch", type=int, default=256, help="batch size on CUDA")
    parser.add_argument("--gsm8k-prompts", type=int, default=64, help="GSM8K-shaped prompts")
    parser.add_argument("--gsm8k-tokens", type=int, default=256, help="GSM8K-shaped new tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} CPU threads, cuda: {torch.cuda.is_available()}"
    )
    summary = []

    prompts = make_prompts(args.batch, 128)
    print(
        f"\n== decode throughput, CPU, tiny Qwen2, batch {args.batch}, "
        f"{args.new_tokens} new tokens, prompts of {PROMPT_LENGTHS} tokens, T=1 top-k 50"
    )
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = tiny_qwen2(dtype, "cpu")
        ratio = decode_ratio(model, prompts, args.new_tokens, args.rounds, "cpu", name, 256)
        summary.append((f"engine_decode_vs_hf_generate_cpu_{name}", ratio, 3))

    tokenizer = load_tokenizer("tiny:qwen2_gsm8k")
    gsm8k = gsm8k_prompts(tokenizer, args.gsm8k_prompts)
    lengths = [len(p) for p in gsm8k]
    print(
        f"\n== GSM8K shape, CPU: tiny:qwen2_gsm8k (random weights), {len(gsm8k)} GSM8K prompts "
        f"under the chat template ({statistics.mean(lengths):.0f} tokens on average, "
        f"{min(lengths)}-{max(lengths)}), n = 8, {args.gsm8k_tokens} new tokens, T=1"
    )
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = load_model("tiny:qwen2_gsm8k", dtype=dtype, seed=0).eval()
        engine_rate, generate_rate, memory = gsm8k_engine_vs_generate(
            model, gsm8k, 8, args.gsm8k_tokens
        )
        ratio = engine_rate / generate_rate
        print(
            f"  [{name}] generate {generate_rate:.0f} tok/s, engine {engine_rate:.0f} tok/s: "
            f"{ratio:.2f}x; the engine's KV cache at its peak: {memory:.0%} of full-length slots"
        )
        summary.append((f"engine_vs_hf_generate_gsm8k_shape_cpu_{name}", ratio, 3))
    model = load_model("tiny:qwen2_gsm8k", dtype=torch.float32, seed=0).eval()
    same, total = gsm8k_greedy_identical(model, gsm8k[:8], 64)
    print(f"  [fp32] greedy tokens identical to generate: {same}/{total} prompts (64 tokens)")
    greedy_same = (same, total)

    print("\n== weight update mid-generation (tiny Qwen2, fp32, CPU, full state dict)")
    model = tiny_qwen2(torch.float32, "cpu")
    times = weight_update_latency(model, prompts, "cpu")
    ratio = times["mid_run"] / times["load_state_dict"]
    print(
        f"  plain load_state_dict {times['load_state_dict'] * 1e3:.2f} ms; update_weights while "
        f"paused (the copy) {times['copy'] * 1e3:.2f} ms; pause -> update_weights -> resume "
        f"mid-generation {times['mid_run'] * 1e3:.2f} ms (includes finishing the token step in "
        f"flight): {ratio:.2f}x load_state_dict (lower is better)"
    )
    update_ratio = ratio  # the issue sets no goal for it: reported, not a SUMMARY line

    print("\n== log-prob mismatch, engine vs policy recompute (T=0.8, 64 tokens x 16 prompts)")
    mismatch = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = tiny_qwen2(dtype, "cpu")
        mismatch[f"cpu_{name}"] = logprob_mismatch(model, prompts[:16], "cpu", f"cpu {name}")

    if torch.cuda.is_available():
        print(
            f"\n== decode throughput, CUDA ({torch.cuda.get_device_name()}), Qwen2.5-0.5B "
            f"architecture, bf16, batch {args.gpu_batch}, {args.new_tokens} new tokens"
        )
        model = qwen25_05b(torch.bfloat16, "cuda")
        gpu_prompts = make_prompts(args.gpu_batch, model.config.vocab_size)
        ratio = decode_ratio(
            model, gpu_prompts, args.new_tokens, args.rounds, "cuda", "cuda bf16", 512
        )
        summary.append(("engine_decode_vs_hf_generate_cuda_qwen2.5-0.5b", ratio, 3))
        engine = TorchEngine(model, max_num_seqs=args.gpu_batch, max_model_len=512)
        sampling = SamplingParams(top_k=50, max_tokens=args.new_tokens, ignore_eos=True)
        rate = run_engine(engine, gpu_prompts, sampling, "cuda")
        avg_context = statistics.mean(PROMPT_LENGTHS) + args.new_tokens / 2
        bound = memory_bound_tokens_per_s(model, args.gpu_batch, avg_context)
        print(
            f"  engine {rate:.0f} tok/s = {rate / bound:.1%} of the memory-bandwidth bound "
            f"{bound:.0f} tok/s"
        )
        mismatch["cuda_bf16"] = logprob_mismatch(model, gpu_prompts[:16], "cuda", "cuda bf16")
    else:
        print("\n(no CUDA device: the GPU figures are not measured in this run)")

    print()
    print(
        "LOGPROB max |engine - policy recompute|: "
        + ", ".join(f"{name} {value:.2e}" for name, value in mismatch.items())
    )
    print(
        f"WEIGHT_UPDATE pause->update->resume mid-generation {update_ratio:.2f}x a plain "
        "load_state_dict (lower is better)"
    )
    print(f"GREEDY GSM8K shape, engine = generate: {greedy_same[0]}/{greedy_same[1]} prompts")
    for name, ratio, goal in summary:
        print(f"SUMMARY {name} {ratio:.2f}x goal {goal}x")


if __name__ == "__main__":
    main()
