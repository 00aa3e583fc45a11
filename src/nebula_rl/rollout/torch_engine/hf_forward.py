"""The forward for any other causal LM: the HF modules themselves, each layer handed its
sequences' cached keys and values gathered from the paged cache."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from nebula_rl.rollout.multimodal import (
    PromptEmbeddings,
    is_multimodal,
    language_model,
)
from nebula_rl.rollout.torch_engine.blocks import (
    _additive_chunk_mask,
    _BlockPool,
    _DecodeBatch,
    _past_tokens,
    _token_major,
)
from nebula_rl.rollout.torch_engine.fused import _Past
from nebula_rl.rollout.torch_engine.model import _lm_head, _ModelDims

# (layer, keys, values) -> the keys and values to attend over, as HF attention layers expect them.
_CacheWrite = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _SlotCache:
    """Duck-typed `transformers` Cache that writes into and reads from the paged cache.

    Used by the HF-module forward: attention layers call `update(k, v, layer_idx)` and attend
    over what it returns, with the 4D mask the engine passes in.
    """

    is_compileable = False

    def __init__(self, write: _CacheWrite) -> None:
        self._write = write

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._write(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class _HFForward:
    """Runs the HF modules themselves over the paged cache (any causal LM using the Cache API).
    Each attention layer is handed its sequences' keys and values gathered from their blocks
    (prompt and generated tokens one after the other, a mask over what is not theirs)."""

    def __init__(self, model: torch.nn.Module, dims: _ModelDims, cache: _BlockPool) -> None:
        cfg: Any = model.config
        if cfg._attn_implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"forward='hf' needs attn_implementation 'eager' or 'sdpa', got "
                f"{cfg._attn_implementation!r}"
            )
        self.model = model
        self.cache = cache
        # A vision-language model runs its language model and head here (its vision tower ran
        # at admission, `multimodal.embed_prompts`).
        self.multimodal = is_multimodal(model)
        self.text = language_model(model)
        self.head = _lm_head(model)
        # transformers 5 renames `past_key_values` to `cache`, model by model.
        forward = (self.text if self.multimodal else model).forward
        self._cache_key = (
            "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
        )

    def _run(self, rows: torch.Tensor | None, cache: _SlotCache, **kwargs: Any) -> torch.Tensor:
        """fp32 logits of the forward `kwargs` over `cache` at the last token of each sequence
        (`rows`: rather at these positions of each row)."""
        kwargs[self._cache_key] = cache
        if self.multimodal:
            hidden = self.text(use_cache=True, **kwargs).last_hidden_state
            picked = (
                hidden[:, -1]
                if rows is None
                else hidden[torch.arange(len(rows), device=rows.device), rows]
            )
            return self.head(picked).float()
        logits = self.model(use_cache=True, **kwargs).logits
        return (
            logits[:, -1]
            if rows is None
            else logits[torch.arange(len(rows), device=rows.device), rows]
        ).float()

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        batch: _DecodeBatch,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cache, num = self.cache, tokens.shape[0]

        def write(
            layer: int, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            cache.write_token(layer, batch.write, k[:, :, 0], v[:, :, 0])
            k_pre, v_pre, _ = cache.gather(layer, batch.prefix_table, "prefix")
            k_own, v_own, _ = cache.gather(layer, batch.own_table, "own")
            keys = [_token_major(t, num) for t in (k_pre[batch.group], k_own)]
            values = [_token_major(t, num, keys=False) for t in (v_pre[batch.group], v_own)]
            return torch.cat(keys, dim=2), torch.cat(values, dim=2)

        position_ids = positions[:, None]
        if rope_positions is not None:  # M-RoPE: the cache position, then time/height/width
            position_ids = torch.stack([positions, *[rope_positions] * 3])[..., None]
        return self._run(
            None,
            _SlotCache(write),
            input_ids=tokens[:, None],
            position_ids=position_ids,
            attention_mask=batch.mask,
        )

    def prefill(
        self,
        tokens: torch.Tensor,
        last: torch.Tensor,
        table: torch.Tensor,
        start: int = 0,
        past: torch.Tensor | None = None,
        prompt: PromptEmbeddings | None = None,
    ) -> torch.Tensor:
        num_prompts, length = tokens.shape
        cache = self.cache

        def write(
            layer: int, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            cache.write_blocks(layer, table, k, v)
            if past is None:
                return k, v
            k_past, v_past = _past_tokens(cache, layer, past, start)
            return torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)

        mask = _additive_chunk_mask(length, start, cache.k[0].dtype, tokens.device)
        positions = torch.arange(start, start + length, device=tokens.device)
        positions = positions.expand(num_prompts, length)
        slot_cache = _SlotCache(write)
        if prompt is None:
            return self._run(
                last, slot_cache, input_ids=tokens, position_ids=positions, attention_mask=mask
            )
        deepstack = (
            {}
            if prompt.visual_mask is None
            else {
                "visual_pos_masks": prompt.visual_mask,
                "deepstack_visual_embeds": list(prompt.deepstack),
            }
        )
        return self._run(
            last,
            slot_cache,
            inputs_embeds=prompt.embeds,
            position_ids=torch.cat([positions[None], prompt.positions]),
            attention_mask=mask,
            **deepstack,
        )

    def extend(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write: tuple[torch.Tensor, torch.Tensor],
        past: _Past,
        rope_positions: torch.Tensor | None = None,
    ) -> None:
        cache, length = self.cache, tokens.shape[0]

        def write_and_read(
            layer: int, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            cache.write_token(layer, write, k[0].transpose(0, 1), v[0].transpose(0, 1))
            return past.keys_values(cache, layer)

        mask = _additive_chunk_mask(length, past.length - length, cache.k[0].dtype, tokens.device)
        position_ids = positions[None]
        if rope_positions is not None:  # M-RoPE: the cache position, then time/height/width
            position_ids = torch.stack([positions, *[rope_positions] * 3])[:, None]
        self._run(
            None,
            _SlotCache(write_and_read),
            input_ids=tokens[None],
            position_ids=position_ids,
            attention_mask=mask,
        )
