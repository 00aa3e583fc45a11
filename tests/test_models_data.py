import json
import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from nebula_rl.config import DatasetConfig
from nebula_rl.data import (
    arithmetic_task,
    load_rows,
    prompt_token_ids,
    sft_example,
    split_rows,
    validate_rows,
)
from nebula_rl.models import (
    CHATML_TEMPLATE,
    build_char_tokenizer,
    count_parameters,
    load_model,
    load_tokenizer,
)

GSM8K = __import__("pathlib").Path(__file__).parents[1] / "data" / "gsm8k"


def test_char_tokenizer_round_trips_text_and_chat_tokens():
    tok = build_char_tokenizer()
    text = "<|im_start|>user\nWhat is 12+30?<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.eos_token_id
    assert len(ids) == 1 + len("user\nWhat is 12+30?") + 1  # one token per character


def test_non_ascii_round_trips_through_its_bytes():
    tok = build_char_tokenizer()
    assert len(tok) == 4 + 256 + 4  # specials, bytes, vision markers
    for text in ["é", "naïve café", "東京 🙂", "a\rb\x00c"]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("é")) == 2  # its two UTF-8 bytes


@pytest.mark.parametrize("preset", ["tiny:qwen2", "tiny:llama"])
def test_presets_are_a_few_million_parameters(preset):
    model = load_model(preset)
    assert 1_000_000 < count_parameters(model) < 10_000_000
    assert model.config.vocab_size >= len(build_char_tokenizer())


def test_saved_preset_loads_with_auto_classes(tmp_path):
    model, tok = load_model("tiny:qwen2", seed=3), build_char_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    x = torch.tensor([tok2.encode("1+2=")])
    torch.testing.assert_close(again(x).logits, model(x).logits)
    assert tok2.chat_template == tok.chat_template
    assert load_tokenizer(str(tmp_path)).padding_side == "left"


def test_saved_tokenizer_encodes_chat_prompts_like_the_preset(tmp_path):
    # Regression: AutoTokenizer picks Qwen2Tokenizer for a qwen2 config.json, whose byte-level
    # pre-tokenizer dropped the newlines of the chat template from the character tokenizer.
    model = load_model("tiny:qwen2")
    model.save_pretrained(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    preset, saved = load_tokenizer("tiny:qwen2"), load_tokenizer(str(tmp_path))
    for text in ["3+4=", "line one\nline two"]:
        expected = prompt_token_ids(preset, text, system_prompt="be brief")
        assert prompt_token_ids(saved, text, system_prompt="be brief") == expected
        assert preset.encode("\n") == [5] and 5 in expected
    assert saved.pad_token_id == preset.pad_token_id and saved.padding_side == "left"


TEXTS = [
    "hello world",
    "  two  spaces\n\nblank line\tand tab\r\n",
    "12+30=42, 7*8=56",
    "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n7<|im_end|><|endoftext|>",
    "naïve café 東京 🙂",
]


@pytest.mark.parametrize("preset", ["tiny:qwen2", "tiny:llama"])
def test_exported_preset_tokenizer_loads_exactly_with_auto_tokenizer(tmp_path, preset):
    # Regression: AutoTokenizer picks Qwen2Tokenizer for a qwen2 config.json whatever the saved
    # tokenizer_class says, and it rebuilt the old character tokenizer with a byte-level
    # pre-tokenizer that dropped spaces and newlines.
    load_model(preset).save_pretrained(tmp_path)
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert auto.encode(text) == ids
        assert auto.decode(ids) == tok.decode(ids) == text
    assert auto.encode("e\u0301") == tok.encode("e\u0301") == tok.encode("é")  # both NFC
    messages = [
        {"role": "system", "content": "Add.  Be brief."},
        {"role": "user", "content": "12 + 30 =\n?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "1+1="},
    ]
    for kwargs in [{"tokenize": False}, {"tokenize": True, "return_dict": False}]:
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        assert auto.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == expected
    special = ["eos_token_id", "pad_token_id", "unk_token_id", "bos_token_id"]
    assert [getattr(auto, k) for k in special] == [getattr(tok, k) for k in special]
    assert auto.convert_tokens_to_ids("<|im_start|>") == tok.convert_tokens_to_ids("<|im_start|>")


def _character_tokenizer_of_old_exports() -> PreTrainedTokenizerFast:
    """The preset tokenizer exports carried before the byte-level one (a copy of its builder)."""
    from tokenizers import Tokenizer, decoders, models, trainers

    alphabet = [c for c in string.printable if c not in "\x0b\x0c\r"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + len(alphabet),
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator([string.printable], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def test_folders_exported_before_the_byte_level_preset_still_load(tmp_path):
    load_model("tiny:qwen2").save_pretrained(tmp_path)
    old = _character_tokenizer_of_old_exports()
    old.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    text = TEXTS[1].replace("\r", "") + TEXTS[3]  # (it had no token for \r)
    assert loaded.encode(text) == old.encode(text) and loaded.decode(old.encode(text)) == text
    # ASCII text keeps its ids across the two presets
    assert build_char_tokenizer().encode(text) == old.encode(text)


def test_missing_model_path_is_a_clear_error(tmp_path):
    # An absolute path cannot be a Hub id (owner/name), so nothing is looked up on the Hub.
    with pytest.raises(ValueError, match="neither a local folder nor a Hugging Face Hub id"):
        load_model(str(tmp_path / "Qwen" / "Qwen2.5-0.5B"))


def test_arithmetic_rows_are_correct_and_seeded():
    rows = arithmetic_task(num_samples=50, max_operand=9, ops="+-*", seed=3)
    assert rows == arithmetic_task(num_samples=50, max_operand=9, ops="+-*", seed=3)
    assert rows != arithmetic_task(num_samples=50, max_operand=9, ops="+-*", seed=4)
    for row in rows:
        assert str(eval(row["prompt"].rstrip("="))) == row["answer"]


def test_builtin_unknown_option_is_an_error():
    with pytest.raises(ValueError, match="unknown option"):
        load_rows(DatasetConfig(name="builtin:arithmetic", kwargs={"digits": 2}))


def test_local_jsonl_parquet_and_saved_folder(tmp_path):
    import datasets

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_rows(DatasetConfig(name=str(tmp_path))) == rows
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    assert load_rows(DatasetConfig(name=str(tmp_path / "p.parquet"))) == rows
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(DatasetConfig(name=str(tmp_path / "saved"))) == rows


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(DatasetConfig(name=str(tmp_path / "none")))


def test_gsm8k_from_local_files():
    rows = load_rows(DatasetConfig(name=str(GSM8K), split="test"))
    assert len(rows) == 1319
    assert "####" in rows[0]["answer"]


def test_default_split_reads_the_train_files_only():
    # Regression: the default split is the string "train", once read as the splits t, r, a, i, n
    # (so "t*" matched test.jsonl too).
    assert len(load_rows(DatasetConfig(name=str(GSM8K)))) == 7473


def test_prompt_ids_use_chat_template():
    tok = build_char_tokenizer()
    ids = prompt_token_ids(tok, "3+5=", system_prompt="Add.")
    assert (
        tok.decode(ids)
        == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sft_mask_covers_only_assistant_turns():
    tok = build_char_tokenizer()
    msgs = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = sft_example(tok, msgs)
    assert len(ids) == len(mask)
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "2<|im_end|>\n4<|im_end|>\n"
    assert tok.decode(ids).count("<|im_start|>") == 4


def test_validate_rows_counts_bad_rows():
    rows = [{"p": "a", "a": "1"}, {"p": "", "a": "2"}, {"a": "3"}, {"p": "b", "a": None}]
    good, report = validate_rows(rows, columns=["p", "a"])
    assert good == rows[:1]
    assert report.num_bad == 3
    assert report.reasons == {"missing or empty 'p'": 2, "missing or empty 'a'": 1}


def test_split_rows_is_disjoint_and_complete():
    rows = [{"i": i} for i in range(100)]
    train, test = split_rows(rows, 0.2, seed=1)
    assert len(test) == 20 and len(train) == 80
    assert sorted(r["i"] for r in train + test) == list(range(100))
    with pytest.raises(ValueError, match="test_size"):
        split_rows(rows, 100)


def test_data_module_imports_no_heavy_library():
    # The controller reads datasets and must stay free of torch, transformers and datasets.
    import subprocess
    import sys

    heavy = "{'torch', 'transformers', 'datasets'}"
    code = f"import sys, nebula_rl.data; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
