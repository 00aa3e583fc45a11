"""Where the parts of a Hugging Face model sit, for the parallelisms that split it: the decoder
stack and its layers (of a causal LM, a pipeline stage or a vision-language model's language
model), the vision tower and its blocks, tied embeddings, sliding-window attention."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PretrainedConfig


def decoder_stack(model: nn.Module) -> Any:
    """The decoder stack (`model.model`) of an HF causal LM or of a pipeline stage; of a
    vision-language model, its language model's (`model.model.language_model`)."""
    decoder = getattr(model, "model", None)
    if decoder is not None and hasattr(decoder, "language_model"):
        decoder = decoder.language_model
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError(
            f"{type(model).__name__} has no `model.layers`; nebula-rl parallelises Hugging Face "
            "decoder-only causal LMs"
        )
    return decoder


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(decoder_stack(model).layers.children())


def vision_blocks(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision tower blocks (`model.model.visual.blocks`; a SigLIP2
    tower's, Cosmos 3 Edge's, `model.model.visual.encoder.layers`); none for a language model."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    blocks = getattr(visual, "blocks", None)
    if blocks is None:
        blocks = getattr(getattr(visual, "encoder", None), "layers", None)
    return list(blocks.children()) if blocks is not None else []


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision tower (`model.model.visual`), and the projector into
    the language model where it sits outside the tower (Cosmos 3 Edge's `model.model.projector`;
    Qwen-VL's merger is the tower's)."""
    inner = model.get_submodule("model")
    projector = getattr(inner, "projector", None)
    return [inner.get_submodule("visual"), *([projector] if projector is not None else [])]


def model_config(model: nn.Module) -> Any:
    return model.config


def tied_embeddings(model: nn.Module) -> bool:
    return bool(model_config(model).tie_word_embeddings)


def windowed_attention(config: PretrainedConfig) -> bool:
    """Whether some attention layer of `config`'s model attends over a sliding window."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    if hasattr(text, "use_sliding_window"):
        return bool(text.use_sliding_window)
    return getattr(text, "sliding_window", None) is not None
