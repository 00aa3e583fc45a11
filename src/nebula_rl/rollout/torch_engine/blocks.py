"""The paged KV cache: per-layer blocks of keys and values (`_BlockPool`), a decode step's
batch of sequences, and the attention that reads their blocks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class _BlockPool:
    """Per-layer keys and values in fixed-size blocks of `block_size` tokens (a paged cache).

    A block is [num_kv_heads, head_dim, block_size] of keys (stored transposed: attention is then
    q @ K, a plain matmul, about twice as fast on CPU as q @ K^T) and [num_kv_heads, block_size,
    head_dim] of values. A prompt's keys and values fill blocks of their own, which all of its
    samples read (a GRPO group's prompt is cached once, not n times); each sample's generated
    tokens fill blocks of its own. Block tables (tensors of block ids) say which blocks a
    sequence reads. Block 0 is never handed out: tables point their unused entries at it, and
    what attention reads there is masked.

    Allocation is host-side bookkeeping: `reserve` promises blocks (admission reserves a
    sample's whole completion, so decoding never runs out and nothing is preempted), `take`
    hands out promised blocks as sequences grow, `give_back` returns them when they finish.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        shape_k = (num_blocks, num_kv_heads, head_dim, block_size)
        shape_v = (num_blocks, num_kv_heads, block_size, head_dim)
        self.k = [torch.zeros(shape_k, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape_v, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._free = list(range(num_blocks - 1, 0, -1))  # (a stack: low ids first)
        self._promised = 0
        # Warm buffers for gathered blocks, grown on demand (first touch of fresh memory is slow).
        self._buffers: dict[str, torch.Tensor] = {}
        self._kept: dict[str, object] = {}
        """The key each kept buffer holds the blocks of."""

    @property
    def num_free(self) -> int:
        """Blocks neither in use nor promised."""
        return len(self._free) - self._promised

    @property
    def num_used(self) -> int:
        """Blocks holding keys and values (block 0 not counted)."""
        return self.num_blocks - 1 - len(self._free)

    def reserve(self, count: int) -> None:
        assert count <= self.num_free, "reserve() past the free blocks"
        self._promised += count

    def unreserve(self, count: int) -> None:
        assert 0 <= count <= self._promised
        self._promised -= count

    def take(self, count: int) -> list[int]:
        """`count` promised blocks."""
        assert count <= self._promised
        self._promised -= count
        return [self._free.pop() for _ in range(count)]

    def give_back(self, blocks: Iterable[int]) -> None:
        self._free.extend(sorted(blocks, reverse=True))

    def write_index(
        self, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices where one token per sequence goes (`blocks`, `offsets`: [S]): K elements
        [S * kv_heads * head_dim], V rows of head_dim [S * kv_heads]."""
        kv, hd, size = self.num_kv_heads, self.head_dim, self.block_size
        heads = torch.arange(kv, device=blocks.device)
        rows = blocks[:, None] * kv + heads  # [S, kv]
        dims = torch.arange(hd, device=blocks.device)
        k_index = ((rows[:, :, None] * hd + dims) * size + offsets[:, None, None]).view(-1)
        v_index = (rows * size + offsets[:, None]).view(-1)
        return k_index, v_index

    def write_token(
        self,
        layer: int,
        index: tuple[torch.Tensor, torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Write one token per sequence: k, v are [S, kv_heads, head_dim]; into `blocks` (K and
        V blocks laid out as the pool's, e.g. gathered copies) instead of the pool's."""
        k_blocks, v_blocks = (self.k[layer], self.v[layer]) if blocks is None else blocks
        k_blocks.reshape(-1).index_copy_(0, index[0], k.reshape(-1))
        v_blocks.reshape(-1, self.head_dim).index_copy_(0, index[1], v.reshape(-1, self.head_dim))

    def write_blocks(
        self, layer: int, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write prompt tokens: k, v are [U, kv_heads, L, head_dim]; row u goes to the blocks
        table[u] [count] in order, count * block_size >= L (entries past a row's own blocks
        point at block 0)."""
        num, kv, length, hd = k.shape
        size = self.block_size
        count = table.shape[1]
        pad = count * size - length
        if pad:
            k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        # [U, kv, count, size, hd] -> K blocks [U, count, kv, hd, size], V [U, count, kv, size, hd]
        k = k.view(num, kv, count, size, hd).permute(0, 2, 1, 4, 3)
        v = v.view(num, kv, count, size, hd).transpose(1, 2)
        ids = table.reshape(-1)
        self.k[layer].view(self.num_blocks, -1).index_copy_(0, ids, k.reshape(len(ids), -1))
        self.v[layer].view(self.num_blocks, -1).index_copy_(0, ids, v.reshape(len(ids), -1))

    def gather(
        self, layer: int, table: torch.Tensor, name: str, *, key: object = None
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The blocks of `table` [N, count]: K [N, count, kv, head_dim, size] and V
        [N, count, kv, size, head_dim], copied into warm buffers (valid until the next gather
        under the same name), and whether they were copied now.

        `key`: the caller keeps these copies up to date while it gathers again with the same
        key (the same blocks in the same places: what changes, it writes into the copies
        itself), so each layer keeps its own and copies only for a new key."""
        ids = table.reshape(-1)
        width = self.k[layer][0].numel()
        kept = key is not None
        if kept:
            name = f"{name}.{layer}"
        shape = (*table.shape, self.num_kv_heads)
        out_k = self._buffer(f"{name}.k", len(ids) * width)
        out_v = self._buffer(f"{name}.v", len(ids) * width)
        views = (
            out_k.view(*shape, self.head_dim, self.block_size),
            out_v.view(*shape, self.block_size, self.head_dim),
        )
        if kept:
            if self._kept.get(name) is key:
                return (*views, False)
            self._kept[name] = key
        torch.index_select(
            self.k[layer].view(self.num_blocks, -1), 0, ids, out=out_k.view(len(ids), -1)
        )
        torch.index_select(
            self.v[layer].view(self.num_blocks, -1), 0, ids, out=out_v.view(len(ids), -1)
        )
        return (*views, True)

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            layer0 = self.k[0]
            buffer = torch.empty(
                max(numel, 2 * (0 if buffer is None else buffer.numel())),
                dtype=layer0.dtype,
                device=layer0.device,
            )
            self._buffers[name] = buffer
        return buffer[:numel]


@dataclass(frozen=True, slots=True)
class _DecodeBatch:
    """Where the sequences of one decode step read and write the paged cache.

    Sequence s continues prompt `group[s]` (a row of `prefix_table`), as the `member[s]`-th of
    that prompt's sequences in the step; `width` is the most sequences of one prompt."""

    own_table: torch.Tensor
    """[S, n] the blocks of each sequence's generated tokens (block 0 past its own)."""
    write: tuple[torch.Tensor, torch.Tensor]
    """Flat indices of this step's token (`_BlockPool.write_index`)."""
    own_key: object
    """The same object from step to step while the own blocks stay in the same rows and
    columns of `own_table` (new blocks may fill columns that pointed at block 0)."""
    own_write: tuple[torch.Tensor, torch.Tensor]
    """Flat indices of this step's token in the own blocks laid out as `own_table`."""
    prefix_table: torch.Tensor
    """[R, m] the blocks of the step's R prompts."""
    mask: torch.Tensor
    """[S, 1, 1, (m + n) * block], added to each sequence's attention scores over its prompt's
    blocks then its own: 0 where a token is cached (this step's included), else the most
    negative value of the dtype."""
    group: torch.Tensor
    member: torch.Tensor
    width: int


def _paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: _BlockPool,
    layer: int,
    batch: _DecodeBatch,
    scaling: float,
) -> torch.Tensor:
    """Decode attention over the paged cache, the prompt part shared: q [S, kv, per_kv, hd]
    (per_kv query heads per KV head) -> [S, kv, per_kv, hd].

    Scores against a prompt are computed once for all of the prompt's sequences in the step
    (their queries stacked: one matmul per prompt block instead of one per sequence, so a GRPO
    group of n samples reads its prompt's keys and values once, not n times); each sequence's
    scores against its generated tokens from its own blocks. One softmax over both parts.

    k, v [S, kv, hd]: the step's token, written to the pool already. The copies of the own
    blocks are kept from step to step while the batch's layout stays (`batch.own_key`), the
    step's token written into them, so a step copies each sequence's blocks only after the
    running set or its widest block count changed."""
    num, kv, per, hd = q.shape
    size = cache.block_size
    own, (rows, count), width = batch.own_table.shape[1], batch.prefix_table.shape, batch.width
    q = q * scaling
    k_own, v_own, copied = cache.gather(layer, batch.own_table, "own", key=batch.own_key)
    if not copied:
        cache.write_token(layer, batch.own_write, k, v, blocks=(k_own, v_own))
    q_own = q[:, None].expand(num, own, kv, per, hd).reshape(num * own * kv, per, hd)
    s_own = torch.bmm(q_own, k_own.view(-1, hd, size)).view(num, own, kv, per, size)
    k_pre, v_pre, _ = cache.gather(layer, batch.prefix_table, "prefix", key=batch.prefix_table)
    q_pre = q.new_zeros(rows, width, kv, per, hd)
    q_pre[batch.group, batch.member] = q
    q_pre = q_pre.permute(0, 2, 1, 3, 4).reshape(rows, 1, kv, width * per, hd)
    q_pre = q_pre.expand(rows, count, kv, width * per, hd).reshape(rows * count * kv, -1, hd)
    s_pre = torch.bmm(q_pre, k_pre.view(-1, hd, size)).view(rows, count, kv, width, per, size)
    # Each sequence's scores, prompt then generated tokens: [S, kv, per, (count + own) * size].
    s_pre = s_pre.permute(0, 3, 2, 4, 1, 5)[batch.group, batch.member]
    scores = torch.cat(
        [
            s_pre.reshape(num, kv, per, count * size),
            s_own.permute(0, 2, 3, 1, 4).reshape(num, kv, per, own * size),
        ],
        dim=-1,
    )
    scores += batch.mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    p_pre, p_own = probs.split([count * size, own * size], dim=-1)
    p_own = p_own.reshape(num, kv, per, own, size).permute(0, 3, 1, 2, 4)
    o_own = torch.bmm(p_own.reshape(-1, per, size), v_own.view(-1, size, hd))
    grouped = p_pre.new_zeros(rows, width, kv, per, count, size)
    grouped[batch.group, batch.member] = p_pre.view(num, kv, per, count, size)
    grouped = grouped.permute(0, 4, 2, 1, 3, 5).reshape(rows * count * kv, width * per, size)
    o_pre = torch.bmm(grouped, v_pre.view(-1, size, hd)).view(rows, count, kv, width, per, hd)
    o_pre = o_pre.sum(1)[batch.group, :, batch.member]
    return o_own.view(num, own, kv, per, hd).sum(1) + o_pre


def _chunk_mask(length: int, start: int, device: torch.device) -> torch.Tensor:
    """[L, start + L] bool: token start + i of a chunk sees every token up to itself."""
    columns = torch.arange(start + length, device=device)
    return columns <= start + torch.arange(length, device=device)[:, None]


def _additive_chunk_mask(
    length: int, start: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`_chunk_mask` as HF attention layers take it: [1, 1, L, start + L] of `dtype`, 0 where a
    token sees, the dtype's most negative value where it does not."""
    mask = torch.zeros(length, start + length, dtype=dtype, device=device)
    return mask.masked_fill_(~_chunk_mask(length, start, device), torch.finfo(dtype).min)[
        None, None
    ]


def _past_tokens(
    cache: _BlockPool, layer: int, past: torch.Tensor, start: int, name: str = "past"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, kv, start, head_dim] of a sequence's first `start` tokens in the
    blocks `past` [1, c] (gathered into the warm buffer `name`)."""
    k, v, _ = cache.gather(layer, past, name)
    return _token_major(k, 1)[:, :, :start], _token_major(v, 1, keys=False)[:, :, :start]


def _token_major(blocks: torch.Tensor, num: int, *, keys: bool = True) -> torch.Tensor:
    """Gathered blocks [S, count, kv, hd, size] (keys) or [S, count, kv, size, hd] (values) as
    HF attention takes them: [S, kv, count * size, hd]."""
    t = blocks.permute(0, 2, 1, 4, 3) if keys else blocks.transpose(1, 2)
    return t.reshape(num, t.shape[1], -1, t.shape[-1])
