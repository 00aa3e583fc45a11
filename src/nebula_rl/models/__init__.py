"""Models and tokenizers: any Hugging Face causal LM or vision-language model from a local folder
or the Hub, or a tiny preset.

A name is a local folder, a Hub repo id fetched into the Hugging Face cache (see
:mod:`nebula_rl.models.hub`), or a preset. A preset (`tiny:qwen2`, `tiny:llama`, and the
vision-language `tiny:qwen3_vl`, `tiny:qwen2_5_vl`, and Cosmos 3's reasoners `tiny:cosmos3_omni`
and `tiny:cosmos3_edge`) is a few-million-parameter model of that architecture with random
initialisation and a byte-level tokenizer without merges built locally with the `tokenizers`
library. `tiny:qwen2_gsm8k` is a
larger one (~14M parameters, the GSM8K-shaped benchmark's) with a byte-level BPE tokenizer of 4096
tokens trained on GSM8K's training text, shipped in this package (`gsm8k_tokenizer.json`,
rebuilt by `python -m nebula_rl.models.bpe`); `tiny:qwen2_5_0_5b` is Qwen2.5-0.5B's shape with that
tokenizer (~0.36B parameters, for GPU benchmarks). Exported, a preset is an ordinary Hugging Face
folder (config, safetensors, tokenizer, ChatML chat template). Presets exist for tests, demos and
benchmarks and are never downloaded.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from nebula_rl.models.hub import is_hub_id, resolve_model

__all__ = [
    "CHATML_TEMPLATE",
    "GSM8K_TOKENIZER_FILE",
    "TINY_PRESETS",
    "VISION_TOKENS",
    "build_char_tokenizer",
    "build_gsm8k_tokenizer",
    "build_tiny_model",
    "check_fp8_gpu",
    "count_parameters",
    "is_hub_id",
    "is_vision_language",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "media_token_ids",
    "resolve_dtype",
    "resolve_model",
]

PRESET_PREFIX = "tiny:"

# ChatML, as the Qwen family uses it. `{% generation %}` marks the assistant's tokens so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` works; nebula-rl's SFT masking
# does not rely on it (it works with any template), but other tools may. A message's content is
# a string or, as Qwen-VL's template takes it, a list of items: {"type": "text", "text": ...},
# and images and videos, written as `<|vision_start|><|image_pad|><|vision_end|>` (or
# `<|video_pad|>`) for the processor to expand to the media's number of tokens.
_CONTENT = (
    "{% if content is string %}{{ content }}{% else %}{% for item in content %}"
    "{% if item['type'] == 'image' or 'image' in item %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    f"{_CONTENT}{{{{ '<|im_end|>' }}}}{{% endgeneration %}}{{{{ '\n' }}}}"
    f"{{% else %}}{_CONTENT}{{{{ '<|im_end|>' + '\n' }}}}{{% endif %}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen-VL's vision markers; in the preset tokenizer they come after the bytes, so that the ids
of every other token stay what they were before presets could see."""

# Architecture settings of each preset; vocab_size is filled in from the tokenizer (rounded up).
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    # The GSM8K-shaped benchmark's model (configs/bench_gsm8k.toml): ~14M parameters, with the
    # GSM8K BPE tokenizer (see _PRESET_TOKENIZERS), room for a prompt and 256 new tokens.
    "qwen2_gsm8k": dict(
        model_type="qwen2",
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    # The GPU benchmark job's model (configs/gpu_gsm8k.toml): Qwen2.5-0.5B's shape (layers,
    # widths, heads, tied embeddings, rope_theta) with the GSM8K BPE tokenizer's 4096-token
    # vocabulary instead of 151936, so ~0.36B parameters.
    "qwen2_5_0_5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # Vision-language presets: a small ViT (patches of 16 or 14 px, merged 2x2 into one language
    # token, 2 frames per temporal patch) in front of a small language model with 3-D (M-RoPE)
    # positions. The vision token ids are filled in from the tokenizer.
    "qwen3_vl": dict(
        model_type="qwen3_vl",
        text_config=dict(
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=1024,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                mrope_section=[8, 4, 4],
                mrope_interleaved=True,
            ),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=128,
            num_position_embeddings=64,
            deepstack_visual_indexes=[1],
        ),
        tie_word_embeddings=True,
    ),
    "qwen2_5_vl": dict(
        model_type="qwen2_5_vl",
        text_config=dict(
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            max_window_layers=4,
            rope_parameters=dict(
                rope_type="default", rope_theta=1000000.0, mrope_section=[4, 6, 6]
            ),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=128,
            window_size=56,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        tie_word_embeddings=True,
    ),
}
# Cosmos 3's reasoner (Cosmos3-Nano, -Super: `Cosmos3OmniForConditionalGeneration`) is Qwen3-VL's
# architecture under its own model type: its preset is the Qwen3-VL one's.
TINY_PRESETS["cosmos3_omni"] = {**TINY_PRESETS["qwen3_vl"], "model_type": "cosmos3_omni"}
# Cosmos 3 Edge (`Cosmos3EdgeForConditionalGeneration`): a SigLIP2-style vision tower (patches of
# 16 px, one frame per temporal patch, a learned grid of position embeddings) merged 2x2 by a
# projector into a language model with squared-ReLU MLPs and M-RoPE.
TINY_PRESETS["cosmos3_edge"] = dict(
    model_type="cosmos3_edge",
    text_config=dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[8, 4, 4]),
    ),
    vision_config=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        num_patches=64,
    ),
    projector_hidden_size=256,
    tie_word_embeddings=False,  # (Edge's head is its own, as in the released model)
)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE
    vocabulary. Printable Latin-1 bytes stand for themselves; the others (space, newline, control
    bytes, ...) for the characters from U+0100 on, in byte order (space is `Ġ`, newline `Ċ`)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = (b for b in range(256) if b not in printable)
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(0x100 + i) for i, b in enumerate(shifted)},
    }


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges, plus the ChatML special tokens: one token per
    byte, so one per character of ASCII text, and any other text round-trips through its bytes.

    It is the pipeline transformers' Qwen2Tokenizer builds from a saved vocabulary (NFC, byte-level
    symbols, byte-level decoding; Qwen2's word split cannot change tokens without merges), so an
    export next to a qwen2 config loads identically with plain `AutoTokenizer.from_pretrained`,
    which picks Qwen2Tokenizer for that model type whatever `tokenizer_class` says; other model
    types load the saved tokenizer.json as it is. Ids: the special tokens, then tab, newline,
    space and `!`..`~` (the ids of the character tokenizer this replaced), then the other bytes,
    then Qwen-VL's vision markers (:data:`VISION_TOKENS`); `<unk>` keeps its id although every
    byte now has a token.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    symbols = _byte_symbols()
    ascii_bytes = [ord(c) for c in string.printable if c not in "\x0b\x0c\r"]
    order = [*sorted(ascii_bytes), *(b for b in range(256) if b not in ascii_bytes)]
    tokens = [*SPECIAL_TOKENS, *(symbols[b] for b in order), *VISION_TOKENS]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return _chatml_tokenizer(tok, additional_special_tokens=["<|im_start|>", *VISION_TOKENS])


GSM8K_TOKENIZER_FILE = Path(__file__).with_name("gsm8k_tokenizer.json")
"""The `tiny:qwen2_gsm8k` preset's tokenizer (package data), trained by
:func:`nebula_rl.models.bpe.train_gsm8k_tokenizer` on `data/gsm8k/train.jsonl`."""


def build_gsm8k_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer of `tiny:qwen2_gsm8k`: 4096 tokens (the ChatML special tokens
    at the ids of :func:`build_char_tokenizer`, the 256 bytes, then merges) trained on GSM8K's
    training questions and answers with Qwen2's pipeline (NFC, Qwen2's word split with single
    digits, byte-level symbols), so an export next to a qwen2 config loads identically with plain
    `AutoTokenizer.from_pretrained`. GSM8K text takes ~0.36 tokens per character."""
    from tokenizers import Tokenizer

    return _chatml_tokenizer(
        Tokenizer.from_file(str(GSM8K_TOKENIZER_FILE)),
        additional_special_tokens=["<|im_start|>"],
    )


def _chatml_tokenizer(tok: Any, *, additional_special_tokens: list[str]) -> PreTrainedTokenizerFast:
    """`tok` (a `tokenizers.Tokenizer` holding :data:`SPECIAL_TOKENS`) as a preset tokenizer:
    `<|im_end|>` ends a turn and generation, `<|endoftext|>` pads on the left, ChatML template."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=additional_special_tokens,
        model_max_length=4096,
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


_PRESET_TOKENIZERS = {
    "qwen2_gsm8k": build_gsm8k_tokenizer,
    "qwen2_5_0_5b": build_gsm8k_tokenizer,
}
"""Presets whose tokenizer is not :func:`build_char_tokenizer`."""


def _preset_tokenizer(preset: str) -> PreTrainedTokenizerFast:
    return _PRESET_TOKENIZERS.get(preset, build_char_tokenizer)()


def _tiny_config(
    preset: str, *, vocab_size: int, pad_token_id: int | None, eos_token_id: int | None
) -> PretrainedConfig:
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; choose from {sorted(TINY_PRESETS)}")
    settings = dict(TINY_PRESETS[preset])
    model_type = settings.pop("model_type")

    ids = dict(
        vocab_size=(vocab_size + 63) // 64 * 64,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    if "text_config" not in settings:
        return AutoConfig.for_model(model_type, **ids, **settings)
    tok = build_char_tokenizer()
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    vision_ids = {
        name: tok.convert_tokens_to_ids(token)
        for name, token in zip(names, VISION_TOKENS, strict=True)
    }
    text_config = {**settings.pop("text_config"), **ids}
    return AutoConfig.for_model(model_type, text_config=text_config, **vision_ids, **settings)


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether `config` is a vision-language model's (a vision tower in front of a language
    model, loaded with `AutoModelForImageTextToText`)."""
    return getattr(config, "vision_config", None) is not None


def media_token_ids(config: PretrainedConfig) -> tuple[int, ...]:
    """Token ids a model must never generate: a vision-language model's media placeholders
    (image and video pads, vision start and end), whose places its forward fills with vision
    embeddings; none for a language model. A completion holding one could not be scored again
    by the policy (its forward would count one image token too many), so the engine never
    samples them and the policy's log-probs leave them out alike."""
    if not is_vision_language(config):
        return ()
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return tuple(int(v) for name in names if (v := getattr(config, name, None)) is not None)


def build_tiny_model(
    preset: str,
    *,
    vocab_size: int,
    seed: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> PreTrainedModel:
    """A randomly initialised model of the named preset (see :data:`TINY_PRESETS`)."""
    config = _tiny_config(
        preset, vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id
    )
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    return model


def resolve_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`, for the dtype names the config allows."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(dtypes)}")
    return dtypes[name]


def check_fp8_gpu(device: torch.device, key: str) -> None:
    """Refuse, naming `key`, FP8 matmuls on a CUDA GPU without FP8 matrix units (compute
    capability below 8.9); other devices are the caller's to judge."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"{key} needs a GPU with FP8 matrix units (compute capability 8.9 or later: Ada, "
            f"Hopper, Blackwell); {torch.cuda.get_device_name(device)} has "
            f"{torch.cuda.get_device_capability(device)}"
        )


def _preset_name(name_or_path: str) -> str | None:
    return (
        name_or_path.removeprefix(PRESET_PREFIX) if name_or_path.startswith(PRESET_PREFIX) else None
    )


_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""Saved `tokenizer_class` values that mean "exactly the saved tokenizer.json"."""


def load_tokenizer(name_or_path: str, *, revision: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a local model folder, a Hub repo id at `revision` or a preset; left
    padding, a pad token set. A Hub id is fetched into the Hugging Face cache (see
    :func:`nebula_rl.models.hub.resolve_model`)."""
    preset = _preset_name(name_or_path)
    if preset is not None:
        return _preset_tokenizer(preset)
    path = resolve_model(name_or_path, revision=revision)
    config_file = path / "tokenizer_config.json"
    saved = json.loads(config_file.read_text()) if config_file.is_file() else {}
    saved_class = saved.get("tokenizer_class")
    if saved_class in _GENERIC_TOKENIZER_CLASSES:
        # AutoTokenizer would pick the model type's tokenizer class (Qwen2Tokenizer for a qwen2
        # config), which replaces the saved normalizer and pre-tokenizer: the character tokenizer
        # of exports older than the byte-level preset would silently lose its spaces and
        # newlines. The saved tokenizer.json is the tokenizer.
        tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    revision: str | None = None,
) -> PreTrainedModel:
    """A causal LM from a local Hugging Face folder or a Hub repo id at `revision` (fetched into
    the Hugging Face cache, see :func:`nebula_rl.models.hub.resolve_model`), or a freshly
    initialised preset."""
    preset = _preset_name(name_or_path)
    if preset is not None:
        tok = _preset_tokenizer(preset)
        model = build_tiny_model(
            preset,
            vocab_size=len(tok),
            seed=seed,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    else:
        path = resolve_model(name_or_path, revision=revision)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device=device, dtype=dtype)  # type: ignore[call-arg]


def load_model_config(name_or_path: str, *, revision: str | None = None) -> PretrainedConfig:
    """The config of the model `load_model` would load (no weights read)."""
    preset = _preset_name(name_or_path)
    if preset is not None:
        tok = _preset_tokenizer(preset)
        return _tiny_config(
            preset,
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return AutoConfig.from_pretrained(
        resolve_model(name_or_path, revision=revision), local_files_only=True
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
