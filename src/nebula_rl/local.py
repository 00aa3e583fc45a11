"""Single-process training: the same algorithm code as the distributed runtime, in one loop.

`run(cfg)` trains one model in this process: for RL it alternates generation (the rollout
engine), scoring (the reward functions) and a policy step; for SFT it steps over tokenised
conversations. It writes `metrics.jsonl` (one object per step) and a Hugging Face export under
the run folder. It is the quickest way to try a config, and the reference the multi-process run
is compared against. Simplification: rollouts here are always on-policy (generation waits for
the step), so `allowed_outdated_steps` has no effect in this mode.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from nebula_rl.algorithms import dynamic_sampling_filter
from nebula_rl.config import Config, GrpoConfig, SftConfig, load_config
from nebula_rl.data import load_rows, prompt_token_ids, sft_example, split_rows, validate_rows
from nebula_rl.models import load_model, load_tokenizer, resolve_dtype
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.rewards import combine_rewards, overlong_penalty

__all__ = ["export_hf", "run", "run_dir_for"]

log = logging.getLogger(__name__)


def run_dir_for(cfg: Config) -> Path:
    """`output_dir/<timestamp>`; the timestamp is the start time unless the config fixes it."""
    stamp = cfg.train.timestamp or datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.train.output_dir) / stamp


def export_hf(model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """Write a Hugging Face folder (config, safetensors, tokenizer) that `from_pretrained` loads."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(path)


def _ensure_model(cfg: Config) -> None:
    """Build the policy's starting model by its warm-start config if it is not on disk yet."""
    path, warm = cfg.policy.model_name_or_path, cfg.policy.warmstart_config
    if warm is None or path.startswith("tiny:") or Path(path).exists():
        return
    log.info("%s is missing: building it with the warm-start config %s", path, warm)
    run(load_config(warm))
    if not Path(path).exists():
        raise ValueError(
            f"policy.warmstart_config {warm} ran but did not produce policy.model_name_or_path {path}"
        )


class _MetricsWriter:
    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def _epoch_order(n: int, *, epoch: int, shuffle: bool, seed: int) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def run(cfg: Config) -> Path:
    """Train as configured in this process; returns the run folder."""
    _ensure_model(cfg)
    seed = cfg.train.seed or 0
    torch.manual_seed(seed)
    run_dir = run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    dtype = resolve_dtype(cfg.train.param_dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(cfg.policy.model_name_or_path)
    model = load_model(cfg.policy.model_name_or_path, dtype=dtype, device=device, seed=seed)
    policy = cfg.train.train_policy
    if isinstance(policy, GrpoConfig):
        _run_grpo(cfg, policy, model, tokenizer, run_dir)
    else:
        _run_sft(cfg, policy, model, tokenizer, run_dir)
    if cfg.train.ckpt.export_safetensors:
        export_hf(model, tokenizer, run_dir / "safetensors" / "final")
    return run_dir


def _num_steps(cfg: Config, num_items: int) -> int:
    steps = cfg.train.epoch * (num_items // cfg.train.train_batch_per_replica)
    if cfg.train.max_num_steps is not None:
        steps = min(steps, cfg.train.max_num_steps)
    if steps < 1:
        raise ValueError(
            f"train.train_batch_per_replica ({cfg.train.train_batch_per_replica}) exceeds the "
            f"{num_items} usable dataset rows: no full step"
        )
    return steps


def _prompts(rows: list[dict[str, Any]], p: GrpoConfig, cfg: Config) -> Iterator[Prompt]:
    for epoch in range(cfg.train.epoch):
        for i in _epoch_order(
            len(rows), epoch=epoch, shuffle=p.dataloader_shuffle, seed=cfg.train.seed or 0
        ):
            row = rows[i]
            yield Prompt(
                prompt_id=f"{epoch}:{i}",
                epoch=epoch,
                index=i,
                prompt=row[p.prompt_column_name],
                reference=str(row[p.response_column_name]),
            )


def _hf_generate(
    model, tokenizer, prompts: list[list[int]], *, n: int, cfg: Config, greedy: bool = False
):
    """Stopgap sampler on `model.generate`: (token ids, logprobs, finish reason) per sample."""
    s = cfg.rollout.sampling_config
    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    rows = [[pad] * (width - len(p)) + p for p in prompts for _ in range(n)]
    ids = torch.tensor(rows, device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=(ids != pad).long(),
        do_sample=not greedy,
        temperature=s.temperature if not greedy else None,
        top_k=s.top_k if s.top_k > 0 and not greedy else None,
        top_p=s.top_p if not greedy else None,
        max_new_tokens=cfg.rollout.max_response_length,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    new = out.sequences[:, width:]
    scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
    lps = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)
    results = []
    for row, lp in zip(new.tolist(), lps.tolist(), strict=True):
        if tokenizer.eos_token_id in row:
            end = row.index(tokenizer.eos_token_id) + 1
            results.append((row[:end], lp[:end], "stop"))
        else:
            results.append((row, lp, "length"))
    return results


def _rollout(
    model,
    tokenizer,
    prompts: list[Prompt],
    cfg: Config,
    reward_fn: Callable[[str, str], float],
    version: int,
) -> list[RolloutGroup]:
    p = cfg.grpo
    n = cfg.rollout.n_generation
    prompt_ids = [
        prompt_token_ids(tokenizer, q.prompt, system_prompt=p.system_prompt) for q in prompts
    ]
    model.eval()
    with torch.no_grad():
        samples = _hf_generate(model, tokenizer, prompt_ids, n=n, cfg=cfg)
    groups = []
    for k, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
        completions = []
        for tokens, lps, finish in samples[k * n : (k + 1) * n]:
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            reward = reward_fn(text, prompt.reference)
            if p.overlong_reward.enable_overlong_penalty:
                reward += overlong_penalty(
                    len(tokens),
                    max_response_length=cfg.rollout.max_response_length,
                    buffer_length=p.overlong_reward.buffer_length,
                    penalty_factor=p.overlong_reward.penalty_factor,
                )
            completions.append(Completion(tokens, lps, text, finish, [(0, version)], reward))
        groups.append(RolloutGroup(prompt, ids, completions, replica="local"))
    return groups


def _run_grpo(cfg: Config, p: GrpoConfig, model, tokenizer, run_dir: Path) -> None:
    rows, _ = validate_rows(
        load_rows(p.dataset, seed=cfg.train.seed or 0),
        columns=[p.prompt_column_name, p.response_column_name],
    )
    rows, _held_out = split_rows(rows, p.dataset.test_size, seed=cfg.train.seed or 0)
    total = _num_steps(cfg, len(rows))
    reward_fn = combine_rewards(p.reward_function)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if p.kl_beta > 0 else None
    trainer = PolicyTrainer(
        model, cfg, total_steps=total, pad_id=tokenizer.pad_token_id, ref_model=ref
    )
    writer = _MetricsWriter(run_dir / "metrics.jsonl")
    prompts = _prompts(rows, p, cfg)
    trained: list[str] = []
    for step in range(1, total + 1):
        t0 = time.perf_counter()
        batch: list[RolloutGroup] = []
        gen_time, dropped = 0.0, 0
        while len(batch) < cfg.train.train_batch_per_replica:
            want = [
                q
                for _, q in zip(
                    range(cfg.train.train_batch_per_replica - len(batch)), prompts, strict=False
                )
            ]
            if not want:
                break
            g0 = time.perf_counter()
            groups = _rollout(model, tokenizer, want, cfg, reward_fn, version=step - 1)
            gen_time += time.perf_counter() - g0
            keep = (
                dynamic_sampling_filter(torch.tensor([g.rewards for g in groups]))
                if p.dynamic_sampling_enabled
                else torch.ones(len(groups), dtype=torch.bool)
            )
            batch += [g for g, k in zip(groups, keep.tolist(), strict=True) if k]
            dropped += int((~keep).sum())
        if not batch:
            break
        metrics = trainer.grpo_step(batch)
        trained += [g.prompt.prompt_id for g in batch]
        num_gen_tokens = sum(len(c.token_ids) for g in batch for c in g.completions)
        record = {
            "step": step,
            "policy_version": step,
            **metrics,
            "staleness_mean": 0.0,
            "staleness_max": 0,
            "groups_dropped": dropped,
            "step_time": time.perf_counter() - t0,
            "rollout_tokens_per_s": num_gen_tokens / max(gen_time, 1e-9),
        }
        writer.write(record)
        log.info(
            "step %d/%d reward %.3f loss %.4f len %.1f %.2fs",
            step,
            total,
            record["reward_mean"],
            record["loss"],
            record["response_length_mean"],
            record["step_time"],
        )
    (run_dir / "trained_prompts.json").write_text(json.dumps(trained))


def _run_sft(cfg: Config, p: SftConfig, model, tokenizer, run_dir: Path) -> None:
    by_columns = bool(p.prompt_column_name and p.response_column_name)
    columns = (
        [p.prompt_column_name, p.response_column_name]
        if by_columns
        else [p.conversation_column_name]
    )
    rows, _ = validate_rows(load_rows(p.dataset, seed=cfg.train.seed or 0), columns=columns)
    examples = []
    for row in rows:
        if by_columns:
            messages = [
                {"role": "user", "content": row[p.prompt_column_name]},
                {"role": "assistant", "content": str(row[p.response_column_name])},
            ]
        else:
            messages = row[p.conversation_column_name]
        examples.append(
            sft_example(
                tokenizer,
                messages,
                system_prompt=p.system_prompt,
                max_length=cfg.policy.model_max_length,
            )
        )
    total = _num_steps(cfg, len(examples))
    trainer = PolicyTrainer(model, cfg, total_steps=total, pad_id=tokenizer.pad_token_id)
    writer = _MetricsWriter(run_dir / "metrics.jsonl")
    size = cfg.train.train_batch_per_replica
    step = 0
    for epoch in range(cfg.train.epoch):
        order = _epoch_order(
            len(examples), epoch=epoch, shuffle=p.dataloader_shuffle, seed=cfg.train.seed or 0
        )
        for start in range(0, len(order) - size + 1, size):
            if step >= total:
                return
            step += 1
            t0 = time.perf_counter()
            metrics = trainer.sft_step([examples[i] for i in order[start : start + size]])
            writer.write(
                {"step": step, "epoch": epoch, **metrics, "step_time": time.perf_counter() - t0}
            )
            log.info("sft step %d/%d loss %.4f", step, total, metrics["loss"])
