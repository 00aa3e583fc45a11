"""The compact forward of the Llama family (llama, mistral, qwen2, qwen3 and the language models
of Qwen-VL): the HF module's own parameters, q/k/v and gate/up each as one matmul."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from nebula_rl.rollout.multimodal import (
    PromptEmbeddings,
)
from nebula_rl.rollout.tensor_parallel import TensorParallel
from nebula_rl.rollout.torch_engine.blocks import (
    _BlockPool,
    _chunk_mask,
    _DecodeBatch,
    _paged_attention,
    _past_tokens,
)
from nebula_rl.rollout.torch_engine.layers import (
    _apply,
    _fuse,
    _Linear,
    _linear,
    _Norm,
    _norm,
    _quantized,
    _rms_norm,
)
from nebula_rl.rollout.torch_engine.model import _decoder_layers, _lm_head, _ModelDims


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's parameter tensors: the HF module's own tensors (or fused tensors its
    parameters are views of), which update_weights overwrites in place, so they never go stale."""

    ln1: _Norm
    qkv: _Linear
    o: _Linear
    q_norm: _Norm | None
    k_norm: _Norm | None
    ln2: _Norm
    gate_up: _Linear
    down: _Linear

    def quantized(self) -> _Layer:
        """The same layer with its four matmuls' weights also in FP8 (norms stay as they are)."""
        return replace(
            self,
            qkv=_quantized(self.qkv),
            o=_quantized(self.o),
            gate_up=_quantized(self.gate_up),
            down=_quantized(self.down),
        )

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.get_submodule("self_attn"), layer.get_submodule("mlp")
        has_qk_norm = hasattr(attn, "q_norm")
        return cls(
            ln1=_norm(layer.get_submodule("input_layernorm")),
            qkv=_fuse([attn.get_submodule(name) for name in ("q_proj", "k_proj", "v_proj")]),
            o=_linear(attn.get_submodule("o_proj")),
            q_norm=_norm(attn.get_submodule("q_norm")) if has_qk_norm else None,
            k_norm=_norm(attn.get_submodule("k_norm")) if has_qk_norm else None,
            ln2=_norm(layer.get_submodule("post_attention_layernorm")),
            gate_up=_fuse([mlp.get_submodule("gate_proj"), mlp.get_submodule("up_proj")]),
            down=_linear(mlp.get_submodule("down_proj")),
        )


@dataclass(frozen=True, slots=True)
class _Past:
    """The cached tokens of one running sequence, as `extend` reads them: its prompt's first
    `prompt_len` tokens (blocks `prefix_table` [1, m]), then its own first `own_len` tokens
    (blocks `own_table` [1, n], those being written included)."""

    prefix_table: torch.Tensor
    prompt_len: int
    own_table: torch.Tensor
    own_len: int

    @property
    def length(self) -> int:
        """Tokens of the sequence, the ones being written included."""
        return self.prompt_len + self.own_len

    def keys_values(self, cache: _BlockPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, kv, prompt_len + own_len, head_dim] of the whole sequence."""
        k_prompt, v_prompt = _past_tokens(cache, layer, self.prefix_table, self.prompt_len)
        k_own, v_own = _past_tokens(cache, layer, self.own_table, self.own_len, "past_own")
        return torch.cat([k_prompt, k_own], dim=2), torch.cat([v_prompt, v_own], dim=2)


class _Forward(Protocol):
    """A forward pass over the paged cache (compact, or through the HF modules)."""

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        batch: _DecodeBatch,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per sequence: tokens, positions are [S]; returns logits [S, V] fp32.
        `rope_positions` [S]: the rotary positions where they differ from the cache positions
        (after a multimodal prompt, see `multimodal.py`)."""
        ...

    def prefill(
        self,
        tokens: torch.Tensor,
        last: torch.Tensor,
        table: torch.Tensor,
        start: int = 0,
        past: torch.Tensor | None = None,
        prompt: PromptEmbeddings | None = None,
    ) -> torch.Tensor:
        """Prompt tokens start.. [U, L] (right-padded): writes their KV to the blocks of
        `table` [U, count]; returns fp32 logits at `last` [U, V]. With start > 0 (a chunk of
        one prompt, U = 1) they also attend to the tokens before, in the blocks `past` [1, c].
        `prompt`: their embeddings and M-RoPE positions when some hold images or videos."""
        ...

    def extend(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write: tuple[torch.Tensor, torch.Tensor],
        past: _Past,
        rope_positions: torch.Tensor | None = None,
    ) -> None:
        """Tokens [L] appended to one running sequence (a multi-turn observation): writes their
        keys and values at `write` (`_BlockPool.write_index` of their L places in the
        sequence's own blocks), each attending to `past` and the tokens before it. Positions
        [L] as in `decode`."""
        ...


class _FusedForward:
    """Llama-family forward over the slotted cache, reading the HF module's parameters."""

    def __init__(
        self,
        model: torch.nn.Module,
        dims: _ModelDims,
        cache: _BlockPool,
        max_len: int,
        tp: TensorParallel | None = None,
        fp8: bool = False,
    ) -> None:
        """Build from `model`; call under no_grad (not inference_mode: the parameters it
        re-points must stay ordinary tensors that update_weights can copy into). With `tp`, the
        model holds this rank's slices (`shard_model`) and `dims` counts this rank's heads.
        With `fp8`, the decoder layers' matmuls run in FP8 on weights quantized from the
        model's own (`requantize` after they change); embeddings, norms and the LM head stay."""
        base, layers = _decoder_layers(model)
        self.cache = cache
        self.tp = tp
        self.embed = base.get_submodule("embed_tokens").get_parameter("weight")
        self.num_heads = dims.num_heads
        self.num_kv_heads = dims.num_kv_heads
        self.head_dim = dims.head_dim
        self.scaling = float(cast(float, layers[0].get_submodule("self_attn").scaling))
        self._modules = layers
        self.fp8 = fp8
        self.layers = self._layers()
        self.final_norm = _norm(base.get_submodule("norm"))
        self.lm_head = _linear(_lm_head(model))
        # RoPE tables from the model's own rotary module (covers its scaling variants; M-RoPE
        # with equal indices on its three axes, as text tokens have).
        self._rotary = base.get_submodule("rotary_emb")
        self.cos, self.sin_signed = self._rope_table(max_len)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, L, head_dim] of `positions` [B, L] (or M-RoPE's [3, B, L])."""
        cos, sin = self._rotary(self.embed[:1], position_ids=positions.to(self.embed.device))
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: one roll instead of a cat.
        signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        dtype = self.embed.dtype
        return cos.to(dtype), signed.to(dtype)

    def _rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rope(torch.arange(length)[None])
        return cos[0], sin[0]

    def rope_room(self, length: int) -> None:
        """Make the rotary tables reach position `length` - 1 (multimodal prompts can move the
        positions after them past the cache length)."""
        if length > self.cos.shape[0]:
            self.cos, self.sin_signed = self._rope_table(length)

    def relink(self) -> None:
        """Fuse again after the parameters were re-pointed at other storage (`.data`, as a
        zero-copy weight receiver does): parts that sit consecutively there become views of it
        again (no copy); others are concatenated anew. The other tensors are read through the
        parameters themselves, which follow by construction."""
        self.layers = self._layers()

    def requantize(self) -> None:
        """Quantize the FP8 weights again from the model's weights (after an update)."""
        self.layers = [layer.quantized() for layer in self.layers]

    def _layers(self) -> list[_Layer]:
        layers = [_Layer.of(layer) for layer in self._modules]
        return [layer.quantized() for layer in layers] if self.fp8 else layers

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * sin

    def _qk_norm(self, qk: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """Qwen3's per-head q/k RMSNorm; qk is [batch, num_heads + num_kv_heads, ..., head_dim]."""
        if layer.q_norm is None or layer.k_norm is None:
            return qk
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([_rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)], dim=1)

    def _project(
        self, x: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (rotated) and values [B, heads, L, head_dim] of `x` [B, L, hidden]."""
        batch, length = x.shape[:2]
        qkv = _apply(_rms_norm(x, layer.ln1), layer.qkv)
        qkv = qkv.view(batch, length, -1, self.head_dim).transpose(1, 2)
        heads = self.num_heads + self.num_kv_heads
        qk = self._rotate(self._qk_norm(qkv[:, :heads], layer), cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, heads:]

    def _row_parallel(self, x: torch.Tensor, linear: _Linear) -> torch.Tensor:
        """`F.linear` of a layer whose input features are split over the TP ranks: the partial
        products are summed over the group, then the (whole) bias is added once."""
        if self.tp is None:
            return _apply(x, linear)
        out = self.tp.all_reduce(_apply(x, linear._replace(bias=None)))
        return out if linear.bias is None else out + linear.bias

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        gate, up = _apply(_rms_norm(x, layer.ln2), layer.gate_up).chunk(2, dim=-1)
        return x + self._row_parallel(F.silu(gate) * up, layer.down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(_rms_norm(x, self.final_norm), self.lm_head).float()

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        batch: _DecodeBatch,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num, hd = tokens.shape[0], self.head_dim
        num_heads, num_kv = self.num_heads, self.num_kv_heads
        x = self.embed[tokens]
        rotary = positions if rope_positions is None else rope_positions
        cos, sin = self.cos[rotary][:, None], self.sin_signed[rotary][:, None]
        for i, layer in enumerate(self.layers):
            qkv = _apply(_rms_norm(x, layer.ln1), layer.qkv).view(num, -1, hd)
            qk = self._rotate(self._qk_norm(qkv[:, : num_heads + num_kv], layer), cos, sin)
            q, k, v = qk[:, :num_heads], qk[:, num_heads:], qkv[:, num_heads + num_kv :]
            self.cache.write_token(i, batch.write, k, v)
            attn = _paged_attention(
                q.reshape(num, num_kv, -1, hd), k, v, self.cache, i, batch, self.scaling
            )
            x = self._mlp(x + self._row_parallel(attn.reshape(num, -1), layer.o), layer)
        return self._logits(x)

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
        num_heads, num_kv = self.num_heads, self.num_kv_heads
        if prompt is None:
            x = self.embed[tokens]
            cos, sin = self.cos[start : start + length], self.sin_signed[start : start + length]
        else:  # per-row M-RoPE tables: [U, 1, P, head_dim] against [U, heads, P, head_dim]
            x = prompt.embeds
            cos, sin = (t[:, None] for t in self._rope(prompt.positions))
        mask = None if past is None else _chunk_mask(length, start, x.device)
        for i, layer in enumerate(self.layers):
            q, k, v = self._project(x, layer, cos, sin)
            self.cache.write_blocks(i, table, k, v)
            if past is not None:  # (a later chunk: the prompt's earlier tokens too)
                k_past, v_past = _past_tokens(self.cache, i, past, start)
                k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
            attn = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scaling,
                enable_gqa=num_heads != num_kv,
            )
            attn = attn.transpose(1, 2).reshape(num_prompts, length, -1)
            x = self._mlp(x + self._row_parallel(attn, layer.o), layer)
            if prompt is not None and i < len(prompt.deepstack):  # Qwen3-VL's DeepStack
                assert prompt.visual_mask is not None
                x[prompt.visual_mask] = x[prompt.visual_mask] + prompt.deepstack[i]
        return self._logits(x[torch.arange(num_prompts, device=x.device), last])

    def extend(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write: tuple[torch.Tensor, torch.Tensor],
        past: _Past,
        rope_positions: torch.Tensor | None = None,
    ) -> None:
        length, num_heads, num_kv = tokens.shape[0], self.num_heads, self.num_kv_heads
        x = self.embed[tokens][None]
        rotary = positions if rope_positions is None else rope_positions
        cos, sin = self.cos[rotary], self.sin_signed[rotary]
        mask = _chunk_mask(length, past.length - length, x.device)
        for i, layer in enumerate(self.layers):
            q, k, v = self._project(x, layer, cos, sin)
            self.cache.write_token(i, write, k[0].transpose(0, 1), v[0].transpose(0, 1))
            k, v = past.keys_values(self.cache, i)
            attn = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=num_heads != num_kv
            )
            x = self._mlp(
                x + self._row_parallel(attn.transpose(1, 2).reshape(1, length, -1), layer.o), layer
            )
