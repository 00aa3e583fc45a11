"""SFT: packed rows give the same log-probs, loss and update as unpacked ones; validation loss
in the local loop; the shipped GSM8K config runs on the local GSM8K files."""

import json
import math
from pathlib import Path

import pytest
import torch

from nebula_rl import local
from nebula_rl.config import config_from_dict, load_config
from nebula_rl.data import sft_example
from nebula_rl.data.packing import (
    block_causal_mask,
    first_fit,
    packed_attention_mask,
    segment_positions,
)
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.trainer import PolicyTrainer, pack_examples, token_logprobs

ROOT = Path(__file__).parents[1]


def test_first_fit_is_greedy_in_order():
    assert first_fit([5, 3, 4, 2, 6, 1], max_length=8) == [[0, 1], [2, 3, 5], [4]]
    with pytest.raises(ValueError, match="more than max_length 8"):
        first_fit([3, 9], max_length=8)


def test_positions_restart_and_mask_is_block_diagonal_causal():
    segments = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = block_causal_mask(segments)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def _examples(tok):
    convs = [
        ("3+4=", "7"),
        ("What is 12 times 11?", "12 * 11 = 132, so the answer is 132."),
        ("hi", "Hello! How can I help?"),
        ("9-5=", "4"),
        ("Name a colour.", "Blue."),
    ]
    examples = [
        sft_example(tok, [{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, a in convs
    ]
    # An example whose first token is marked: position 0 is never a target, packed or not.
    examples.append(([5, 6, 7, 8], [1, 1, 1, 1]))
    return examples


def _sft_cfg(*, packing: bool, max_length: int = 96):
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-2,
                "optm_warmup_steps": 0,
                "optm_grad_norm_clip": 0.0,
                "sequence_packing": packing,
                "train_policy": {"type": "sft", "mini_batch": 2},
            },
            "policy": {"model_max_length": max_length},
        }
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", ["tiny:qwen2", "tiny:llama"])
def test_packed_logprobs_equal_unpacked(preset, attn):
    tok = build_char_tokenizer()
    model = load_model(preset, seed=3).eval()
    model.set_attn_implementation(attn)
    examples = _examples(tok)
    batch = pack_examples(examples, max_length=96, pad_id=tok.pad_token_id)
    assert batch.input_ids.shape[0] < len(examples)  # several examples share a row
    assert batch.segment_ids is not None
    with torch.no_grad():
        packed, _ = token_logprobs(
            model,
            batch.input_ids,
            packed_attention_mask(batch.segment_ids, model.config),
            position_ids=segment_positions(batch.segment_ids),
        )
        # Negative control: a plain causal mask lets later examples see earlier ones.
        leaky, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    num_compared, num_leaky = 0, 0
    for row, indices in enumerate(first_fit([len(ids) for ids, _ in examples], max_length=96)):
        offset = 0
        for i in indices:
            ids = torch.tensor([examples[i][0]])
            with torch.no_grad():
                alone, _ = token_logprobs(model, ids, torch.ones_like(ids))
            n = ids.shape[1] - 1
            got = packed[row : row + 1, offset : offset + n]
            torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
            num_compared += 1
            num_leaky += offset > 0 and not torch.allclose(
                leaky[row : row + 1, offset : offset + n], alone, atol=1e-3
            )
            offset += ids.shape[1]
    assert num_compared == len(examples)
    assert num_leaky > 0


def _trained(cfg, examples, pad_id):
    model = load_model("tiny:llama", seed=4)
    trainer = PolicyTrainer(model, cfg, total_steps=4, pad_id=pad_id)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    val_before = trainer.sft_eval(examples, rows_per_forward=3)
    metrics = trainer.sft_step(examples)
    weights = model.model.layers[1].self_attn.k_proj.weight.detach().clone()
    return val_before, metrics, weights


def test_packed_sft_step_equals_unpacked_with_global_token_count():
    tok = build_char_tokenizer()
    examples = _examples(tok)
    val_u, unpacked, w_u = _trained(_sft_cfg(packing=False), examples, tok.pad_token_id)
    val_p, packed, w_p = _trained(_sft_cfg(packing=True), examples, tok.pad_token_id)
    # The denominator is every assistant target token of the step (position 0 never is one).
    assert packed["num_tokens"] == unpacked["num_tokens"] == sum(sum(m[1:]) for _, m in examples)
    assert unpacked["num_rows"] == len(examples) > packed["num_rows"]
    assert packed["loss"] == pytest.approx(unpacked["loss"], rel=1e-5)
    assert val_p == pytest.approx(val_u, rel=1e-5)
    assert val_u == pytest.approx(unpacked["loss"], rel=1e-5)  # eval is the step's loss
    torch.testing.assert_close(w_p, w_u, rtol=0, atol=1e-5)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_validation_loss_at_freq_and_last_step_decreases(tmp_path):
    cfg = config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "timestamp": "val",
                "optm_lr": 1e-3,
                "optm_warmup_steps": 2,
                "optm_weight_decay": 0.0,
                "train_batch_per_replica": 8,
                "max_num_steps": 22,
                "sequence_packing": True,
                "seed": 1,
                "ckpt": {"export_safetensors": False},
                "train_policy": {
                    "type": "sft",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "mini_batch": 4,
                    "dataset": {
                        "name": "builtin:arithmetic",
                        "test_size": 24,
                        "kwargs": {"num_samples": 200},
                    },
                },
            },
            "policy": {"model_name_or_path": "tiny:qwen2", "model_max_length": 64},
            "validation": {"enable": True, "freq": 5, "val_before_train": True},
        }
    )
    records = _records(local.run(cfg))
    assert [r["step"] for r in records] == list(range(0, 23))
    assert set(records[0]) == {"step", "val_loss"}  # before training: a record of its own
    with_val = [r["step"] for r in records if "val_loss" in r]
    assert with_val == [0, 5, 10, 15, 20, 22]
    assert all(r["num_rows"] < 8 for r in records[1:])  # two conversations fit a 64-token row
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[-1] < 0.5 * val[0], val


def test_validation_without_rows_names_the_keys(tmp_path):
    cfg = config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "train_policy": {
                    "type": "sft",
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 16}},
                },
            },
            "validation": {"enable": True},
        }
    )
    with pytest.raises(ValueError, match=r"validation\.dataset\.name or .*dataset\.test_size"):
        local.run(cfg)


def test_gsm8k_config_trains_two_packed_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config names the dataset relative to the repository root
    cfg = load_config(ROOT / "configs" / "gsm8k_sft.toml")
    assert cfg.train.sequence_packing and cfg.validation.enable
    # The shipped config with a tiny model and two small steps.
    cfg.policy.model_name_or_path = "tiny:qwen2"
    cfg.train.param_dtype = "float32"
    cfg.train.output_dir, cfg.train.timestamp = str(tmp_path), "gsm8k"
    cfg.train.max_num_steps, cfg.train.train_batch_per_replica = 2, 6
    cfg.train.ckpt.export_safetensors = False
    cfg.train.train_policy.mini_batch = 2
    cfg.validation.freq, cfg.validation.max_num_prompts = 1, 4
    records = _records(local.run(cfg))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["loss"]) and math.isfinite(r["val_loss"])
        assert r["num_tokens"] > 6 * 50  # worked solutions, not empty answers
    assert min(r["num_rows"] for r in records) < 6  # some conversations were packed together


def _arithmetic_sft(tmp_path: Path, name: str, **parallelism: int) -> Path:
    # train_batch_per_replica counts conversations per data-parallel rank (as in cosmos-rl):
    # 8 per step in all, however many ranks share them.
    dp = parallelism.get("dp_shard_size", 1) * parallelism.get("dp_replicate_size", 1)
    cfg = config_from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "timestamp": name,
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "train_batch_per_replica": 8 // dp,
                "max_num_steps": 4,
                "seed": 5,
                # (weight averages, kept on each rank's shards, gathered for their export)
                "ema_enable": True,
                "ema_decay": 0.5,
                "train_policy": {
                    "type": "sft",
                    "mini_batch": 4,
                    "prompt_column_name": "prompt",
                    "response_column_name": "answer",
                    "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 64}},
                },
            },
            "policy": {
                "model_name_or_path": "tiny:qwen2",
                "model_max_length": 48,
                "parallelism": parallelism,
            },
        }
    )
    path = tmp_path / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return path


@pytest.mark.parametrize(
    "parallelism",
    [
        {"dp_shard_size": 2},
        # (the others in the slow suite: test_parallelize and test_parallel_grpo step each
        # layout, and every pipeline schedule, like one process fast)
        pytest.param({"dp_replicate_size": 2}, marks=pytest.mark.slow),
        pytest.param({"tp_size": 2}, marks=pytest.mark.slow),
        pytest.param({"pp_size": 2, "pp_schedule": "1F1B"}, marks=pytest.mark.slow),
        pytest.param(
            {"pp_size": 2, "pp_schedule": "GPipe", "pp_micro_batch_size": 2},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"pp_size": 2, "pp_schedule": "Interleaved1F1B", "pp_layers_per_stage": 1},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["fsdp", "ddp", "tp", "pp_1f1b", "pp_gpipe", "pp_interleaved"],
)
def test_sft_on_two_processes_steps_like_one(tmp_path, parallelism):
    """`nebula-rl train` with two ranks (FSDP2, DDP, TP+SP, or two pipeline stages with each
    schedule; it starts its ranks itself, DDP's under torchrun instead): under data parallelism
    each rank takes its half of every batch, under TP and PP both take all of it; the losses
    and the exported weights and weight averages (`train.ema_enable`, `final_ema`) are those of
    one process with the whole batch."""
    from sft_runs import CLI, TORCHRUN, assert_two_like_one, train

    two = [*TORCHRUN, "-m", "nebula_rl.cli"] if "dp_replicate_size" in parallelism else CLI
    for name, launcher in (("one", CLI), ("two", two)):
        train(_arithmetic_sft(tmp_path, name, **(parallelism if name == "two" else {})), launcher)
    # TP sums partial matmuls in another order: after 4 AdamW steps (each moving a weight by
    # ~1e-3) single elements differ by up to ~1.4e-5 (as in test_parallelize.py).
    final = assert_two_like_one(tmp_path, 4, atol=3e-5)
    averages = assert_two_like_one(tmp_path, 4, atol=3e-5, folder="final_ema")
    assert not any(torch.equal(averages[k], final[k]) for k in final if "norm" not in k)
