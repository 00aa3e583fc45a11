"""Training throughput: a policy replica's GRPO step against a hand-written PyTorch loop.

For each shipped config named by `--configs`, one batch shaped like that job's training batch
(`train_batch_per_replica` prompts x `n_generation` completions of the arithmetic task, chat
template applied, responses of `max_response_length / 2 .. max_response_length` tokens) is
trained on three copies of the same randomly initialised model, each with its own AdamW:

1. `plain`: a single-process loop written by hand, given the batch as ready tensors: forward,
   token log-probs, group-normalised advantages, the clipped GRPO loss (token mean, dual clip),
   backward, gradient clipping, AdamW. No framework code.
2. `trainer`: `nebula_rl.policy.trainer.PolicyTrainer.grpo_step` on the batch as the wire's
   `RolloutGroup`s (collation, micro-batching, metrics included).
3. `replica`: what a policy replica does per `train` command besides the weight push (measured
   by bench/weight_sync.py): read the in-flight batch from the job's Redis (a real server),
   decode it, `grpo_step`, push the result.

The rows run interleaved, round after round, so neighbours' load on a shared machine hits all
three alike; the reported time is each row's median, the ratio the median of the per-round
ratios. Tokens/s counts the real (unpadded) prompt and response tokens of the batch. Before
timing, one step of `plain` and `trainer` from the same weights is compared: the largest
parameter difference shows they take the same step.

    python bench/train_throughput.py [--configs configs/demo.toml configs/bench_async.toml]
        [--rounds 10] [--threads 1]

Goal (issue 8): the framework costs at most 10% of the plain loop's tokens/s, i.e.
`replica / plain >= 0.9x`, one SUMMARY line per config.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from nebula_rl.config import Config, load_config
from nebula_rl.controller import JobState, connect, start_redis
from nebula_rl.data import arithmetic_task, prompt_token_ids
from nebula_rl.models import load_model, load_tokenizer
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup

GOAL = 0.9
"""replica tokens/s over plain tokens/s (overhead at most 10%)."""


@dataclass
class PlainBatch:
    """The training batch as tensors, the way a hand-written loop would hold it."""

    input_ids: torch.Tensor
    """[N, L] prompt + response, right-padded."""
    attention_mask: torch.Tensor
    """[N, L] 1 on real tokens."""
    response_mask: torch.Tensor
    """[N, L-1] 1 where the target token (position t + 1) is a response token."""
    old_logprobs: torch.Tensor
    """[N, L-1] the sampler's log-probs at response targets."""
    rewards: torch.Tensor
    """[G, n] one reward per completion."""


def make_groups(
    cfg: Config, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, *, seed: int
) -> list[RolloutGroup]:
    """One training batch of scored groups shaped like `cfg`'s job.

    Prompts are the arithmetic task's under the chat template; response tokens are random; the
    behaviour log-probs are the model's own (as an on-policy rollout would report them), so the
    PPO ratio starts at 1 and clipping is as rare as in a real step."""
    rng = random.Random(seed)
    rows = arithmetic_task(num_samples=cfg.train.train_batch_per_replica, seed=seed)
    longest = cfg.rollout.max_response_length
    vocab = len(tokenizer)
    groups = []
    for index, row in enumerate(rows):
        prompt = Prompt(f"0:{index}", 0, index, row["prompt"], row["answer"])
        ids = prompt_token_ids(tokenizer, row["prompt"])
        completions = []
        for _ in range(cfg.rollout.n_generation):
            tokens = [
                rng.randrange(vocab) for _ in range(rng.randint(max(1, longest // 2), longest))
            ]
            logprobs = _sampled_logprobs(model, ids, tokens)
            completions.append(
                Completion(tokens, logprobs, "", "length", [(0, 0)], float(rng.random() < 0.5))
            )
        groups.append(RolloutGroup(prompt, ids, completions, replica="bench"))
    return groups


@torch.no_grad()
def _sampled_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    return logp[len(prompt) - 1 :].gather(-1, targets[len(prompt) - 1 :, None])[:, 0].tolist()


def plain_batch(groups: list[RolloutGroup], pad_id: int) -> PlainBatch:
    """The groups as padded tensors (done once, outside the timing: a plain loop's data loader
    would hand it over ready)."""
    rows = [(g.prompt_token_ids, c) for g in groups for c in g.completions]
    length = max(len(p) + len(c.token_ids) for p, c in rows)
    input_ids = torch.full((len(rows), length), pad_id)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    response_mask = torch.zeros(len(rows), length - 1)
    old_logprobs = torch.zeros(len(rows), length - 1)
    for i, (prompt, c) in enumerate(rows):
        n, start = len(prompt) + len(c.token_ids), len(prompt) - 1
        input_ids[i, :n] = torch.tensor(prompt + c.token_ids)
        attention_mask[i, :n] = 1
        response_mask[i, start : n - 1] = 1
        old_logprobs[i, start : n - 1] = torch.tensor(c.logprobs)
    rewards = torch.tensor([g.rewards for g in groups])
    return PlainBatch(input_ids, attention_mask, response_mask, old_logprobs, rewards)


def plain_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: PlainBatch, cfg: Config
) -> None:
    """One GRPO step written directly in PyTorch: the same loss as nebula-rl's `grpo` variant
    with `token-mean` (PPO clip-higher, dual clip), in micro-batches of `mini_batch` rows."""
    p = cfg.grpo
    r = batch.rewards
    advantages = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    advantages = torch.where((r == r[:, :1]).all(1, keepdim=True), 0.0, advantages).flatten()
    num_tokens = batch.response_mask.sum()
    for start in range(0, batch.input_ids.shape[0], p.mini_batch):
        rows = slice(start, start + p.mini_batch)
        logits = model(
            input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]
        ).logits[:, :-1]
        logprobs = (
            F.log_softmax(logits.float() / p.temperature, dim=-1)
            .gather(-1, batch.input_ids[rows, 1:, None])
            .squeeze(-1)
        )
        ratio = torch.exp(logprobs - batch.old_logprobs[rows])
        adv = advantages[rows, None]
        loss = torch.maximum(
            -adv * ratio, -adv * ratio.clamp(1 - p.epsilon_low, 1 + p.epsilon_high)
        )
        if p.lower_bound_ratio is not None:
            loss = torch.where(adv < 0, loss.clamp(max=-adv * p.lower_bound_ratio), loss)
        ((loss * batch.response_mask[rows]).sum() / num_tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.optm_grad_norm_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def plain_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW with the config's hyper-parameters and PyTorch's default implementation."""
    t = cfg.train
    return torch.optim.AdamW(
        model.parameters(),
        lr=t.optm_lr,
        betas=t.optm_betas,
        eps=t.epsilon,
        weight_decay=t.optm_weight_decay,
    )


@torch.no_grad()
def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest absolute difference between the two models' parameters."""
    return max(
        float((x - y).abs().max()) for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(config: str, *, rounds: int, redis_dir: Path) -> dict[str, float]:
    """Median step seconds of the three rows on `config`'s batch, plus batch facts."""
    cfg = load_config(config)
    cfg.train.optm_warmup_steps = 0  # full LR from the first step in all rows
    tokenizer = load_tokenizer("tiny:qwen2")
    base = load_model("tiny:qwen2", seed=0)
    groups = make_groups(cfg, base, tokenizer, seed=1)
    batch = plain_batch(groups, tokenizer.pad_token_id)
    models = {name: copy.deepcopy(base) for name in ("plain", "trainer", "replica")}
    optimizer = plain_optimizer(models["plain"], cfg)
    trainers = {
        name: PolicyTrainer(models[name], cfg, total_steps=10**6, pad_id=tokenizer.pad_token_id)
        for name in ("trainer", "replica")
    }
    for model in models.values():
        model.train()

    # The same step: one update of each from identical weights.
    plain_step(models["plain"], optimizer, batch, cfg)
    trainers["trainer"].grpo_step(groups)
    same_step = max_param_diff(models["plain"], models["trainer"])
    moved = max_param_diff(models["plain"], base)

    with start_redis(data_dir=redis_dir) as server:
        state = JobState(connect(server.url), "bench")
        for group in groups:  # into the buffer the way rollouts and the controller put it
            state.push_group(group)
        for msg_id, group in state.poll_groups(len(groups)):
            state.accept_group(group, 0, 1, msg_id=msg_id)
        assert state.next_batch(len(groups)) is not None
        prompt_ids = [g.prompt.prompt_id for g in groups]

        def replica_step() -> None:
            by_id = {g.prompt.prompt_id: g for g in state.inflight_batch()}
            metrics = trainers["replica"].grpo_step([by_id[i] for i in prompt_ids])
            state.push_result({"type": "train", "step": 1, "metrics": metrics})

        steps: dict[str, Callable[[], object]] = {
            "plain": lambda: plain_step(models["plain"], optimizer, batch, cfg),
            "trainer": lambda: trainers["trainer"].grpo_step(groups),
            "replica": replica_step,
        }
        for step in steps.values():  # warm-up: optimiser state, allocator, Redis connection
            step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                times[name].append(timed(step))
        state.redis.close()
    # Per round, so that a neighbour's load during one round weighs on all three rows alike.
    ratios = {
        name: statistics.median(p / t for p, t in zip(times["plain"], times[name], strict=True))
        for name in steps
    }
    return {
        **{name: statistics.median(t) for name, t in times.items()},
        **{f"{name}_ratio": ratio for name, ratio in ratios.items()},
        "tokens": float(batch.attention_mask.sum()),
        "sequences": float(batch.input_ids.shape[0]),
        "same_step": same_step,
        "moved": moved,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configs", nargs="+", default=["configs/demo.toml", "configs/bench_async.toml"]
    )
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a replica: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    results = {}
    with tempfile.TemporaryDirectory(prefix="nebula-bench-train-") as tmp:
        for i, config in enumerate(args.configs):
            results[config] = measure(config, rounds=args.rounds, redis_dir=Path(tmp) / str(i))

    print(f"tiny:qwen2 model, {args.threads} torch thread(s), median of {args.rounds} steps")
    print(
        f"{'config':26} {'seqs':>5} {'tokens':>7} {'row':>8} {'s/step':>8} {'tokens/s':>9} "
        f"{'vs plain':>9}"
    )
    for config, r in results.items():
        for name in ("plain", "trainer", "replica"):
            print(
                f"{config:26} {r['sequences']:5.0f} {r['tokens']:7.0f} {name:>8} "
                f"{r[name]:8.4f} {r['tokens'] / r[name]:9.0f} {r[name + '_ratio']:8.2f}x"
            )
        print(
            f"{'':26} first step, plain vs trainer: max |param diff| {r['same_step']:.1e} "
            f"(the step itself moved them {r['moved']:.1e})"
        )
    for config, r in results.items():
        name = Path(config).stem
        print(f"SUMMARY train_throughput_{name} {r['replica_ratio']:.2f}x goal {GOAL}x")


if __name__ == "__main__":
    main()
