"""The GSM8K-shaped benchmark job: its BPE tokenizer, the `tiny:qwen2_gsm8k` preset and its two
configs (`configs/bench_gsm8k.toml`, `configs/bench_gsm8k_sft.toml`)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest
import torch
from transformers import AutoTokenizer

from nebula_rl.config import load_config
from nebula_rl.data import prompt_token_ids
from nebula_rl.models import (
    CHATML_TEMPLATE,
    GSM8K_TOKENIZER_FILE,
    build_char_tokenizer,
    count_parameters,
    load_model,
    load_tokenizer,
)
from nebula_rl.models.bpe import GSM8K_VOCAB_SIZE, train_gsm8k_tokenizer

ROOT = Path(__file__).parents[1]
GSM8K = ROOT / "data" / "gsm8k"
RL_CONFIG = ROOT / "configs" / "bench_gsm8k.toml"
SFT_CONFIG = ROOT / "configs" / "bench_gsm8k_sft.toml"
PRESET = "tiny:qwen2_gsm8k"


def _rows(split: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in (GSM8K / f"{split}.jsonl").read_text().splitlines()]


def test_retraining_reproduces_the_shipped_tokenizer():
    assert GSM8K_TOKENIZER_FILE.stat().st_size < 400_000
    assert train_gsm8k_tokenizer(GSM8K / "train.jsonl") == GSM8K_TOKENIZER_FILE.read_text()


def test_gsm8k_text_round_trips_in_well_under_one_token_per_character():
    tok = load_tokenizer(PRESET)
    assert len(tok) == GSM8K_VOCAB_SIZE
    texts = [text for row in _rows("test") for text in (row["question"], row["answer"])]
    encoded = [tok.encode(text) for text in texts]
    assert all(tok.decode(ids) == text for ids, text in zip(encoded, texts, strict=True))
    ratio = sum(map(len, encoded)) / sum(map(len, texts))
    assert ratio < 0.4, ratio  # (0.37 on the test split; the byte tokenizer: 1.0)
    for text in ["naïve café 東京 🙂", "a\rb\x00c", "  two  spaces\n\n"]:  # any bytes
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_chat_template_are_the_presets():
    tok, char = load_tokenizer(PRESET), build_char_tokenizer()
    for token in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]:
        assert tok.convert_tokens_to_ids(token) == char.convert_tokens_to_ids(token)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok.chat_template == CHATML_TEMPLATE and tok.padding_side == "left"
    ids = prompt_token_ids(tok, "What is 12+30?", system_prompt="Be brief.")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 2  # the system and user turns end
    assert tok.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_mean_gsm8k_prompt_under_the_chat_template_is_about_a_hundred_tokens():
    # BENCHMARKS.md states it: 108 on the test split (106 on train) with the job's system prompt.
    tok = load_tokenizer(PRESET)
    system = load_config(RL_CONFIG).grpo.system_prompt
    lengths = [
        len(prompt_token_ids(tok, r["question"], system_prompt=system)) for r in _rows("test")
    ]
    assert 100 < mean(lengths) < 115


def test_preset_is_10_to_30m_parameters_and_runs_a_forward():
    model, tok = load_model(PRESET), load_tokenizer(PRESET)
    assert 10_000_000 < count_parameters(model) < 30_000_000
    assert model.config.vocab_size >= len(tok) and model.config.max_position_embeddings >= 1024
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([prompt_token_ids(tok, "What is 12+30?")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_exported_preset_tokenizer_loads_exactly_with_auto_tokenizer(tmp_path):
    load_model(PRESET).save_pretrained(tmp_path)
    tok = load_tokenizer(PRESET)
    tok.save_pretrained(tmp_path)
    auto, saved = AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(str(tmp_path))
    row = _rows("test")[0]
    messages = [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": row["question"]},
        {"role": "assistant", "content": row["answer"]},
    ]
    expected = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    text = row["answer"] + "\n  x \r\n"
    for other in (auto, saved):
        assert other.apply_chat_template(messages, tokenize=True, return_dict=False) == expected
        assert other.encode(text) == tok.encode(text)
        assert (other.eos_token_id, other.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


def test_the_configs_describe_the_gsm8k_shaped_job():
    rl, sft = load_config(RL_CONFIG), load_config(SFT_CONFIG)
    assert (rl.rollout.n_generation, rl.rollout.max_response_length) == (8, 256)
    assert rl.groups_per_replica == 8 and rl.rollout.backend == "torch"
    assert rl.grpo.reward_function == {"gsm8k": 1.0, "answer_format": 0.1}
    assert rl.policy.warmstart_config == "configs/bench_gsm8k_sft.toml"
    # the warm start exports where the RL job loads from, with the same prompt format
    export = Path(sft.train.output_dir) / sft.train.timestamp / "safetensors" / "final"
    assert Path(rl.policy.model_name_or_path) == export
    assert sft.policy.model_name_or_path == PRESET
    assert sft.train.train_policy.system_prompt == rl.grpo.system_prompt
    assert sft.train.train_policy.dataset.name == rl.grpo.dataset.name == "data/gsm8k"


@pytest.mark.parametrize("path", [SFT_CONFIG, RL_CONFIG], ids=lambda p: p.name)
def test_check_command_accepts_the_configs(path):
    # from the repository root, as the configs' relative paths expect (the RL config's model is
    # its warm start, which need not exist yet)
    result = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "check", "--config", str(path.relative_to(ROOT))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr


def test_trl_bench_maps_the_job_and_refuses_what_it_cannot_map_by_key():
    spec = importlib.util.spec_from_file_location("trl_grpo", ROOT / "bench" / "trl_grpo.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.refuse_unmapped(load_config(RL_CONFIG))
    with pytest.raises(SystemExit, match=r"train\.train_policy\.variant = 'dapo'.*overlong"):
        bench.refuse_unmapped(load_config(ROOT / "configs" / "gsm8k_grpo.toml"))
    fp16 = load_config(RL_CONFIG)
    fp16.train.param_dtype = "float16"  # (TRL's side maps float32 and bf16 mixed precision)
    with pytest.raises(SystemExit, match=r"train\.param_dtype = 'float16'"):
        bench.refuse_unmapped(fp16)
