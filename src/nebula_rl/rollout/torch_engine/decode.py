"""A `TorchEngine`'s decode step: one token for every running sequence, read and written in
the paged cache (`_DecodeBatch`), and the sampling and recording of tokens on the device (the
first token after a prefill too), with one device->host sync per step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from nebula_rl.rollout.engine import FinishReason, RequestOutput
from nebula_rl.rollout.sampling import BatchSampling, sample
from nebula_rl.rollout.torch_engine.blocks import _DecodeBatch
from nebula_rl.rollout.torch_engine.multiturn import _MultiTurn


class _Decoding(_MultiTurn):
    """The batched decode forward, and sampling tokens for slots."""

    def _decode(self) -> list[RequestOutput]:
        active = np.flatnonzero(self._active_host)
        size = self.block_size
        written = self._pos_host[active] - self._prompt_len_host[active]  # (generated, cached)
        starts = written % size == 0  # this step's token begins a new block
        if starts.any():
            grow = active[starts].tolist()
            blocks = self.cache.take(len(grow))
            for slot, block in zip(grow, blocks, strict=True):
                self._promised[slot] -= 1
                self._own_blocks[slot].append(block)
            rows = torch.as_tensor(grow, device=self.device)
            cols = torch.as_tensor(written[starts] // size, device=self.device)
            self._own_table[rows, cols] = torch.as_tensor(blocks, device=self.device)
        slots, batch = self._decode_batch(active, written + 1)
        positions = self._pos[slots]
        rope = positions + self._rope_delta[slots] if self.multimodal else None
        logits = self._forward.decode(self._last_token[slots], positions, batch, rope)
        self._pos[slots] = positions + 1
        self._pos_host[active] += 1
        return self._sample_and_record(logits, slots)

    def _decode_batch(
        self, active: np.ndarray, own_len: np.ndarray
    ) -> tuple[torch.Tensor, _DecodeBatch]:
        """The slots of `active` and where they read and write; `own_len`: their generated
        tokens in the cache once this step's is written."""
        device, size = self.device, self.block_size
        if self._groups is None:  # (the active slots changed: group them by prompt again)
            ids = self._prefix_of[active]
            unique, rows = np.unique(ids, return_inverse=True)
            members = np.zeros(len(active), dtype=np.int64)
            counts = np.zeros(len(unique), dtype=np.int64)
            for row, g in enumerate(rows.tolist()):
                members[row] = counts[g]
                counts[g] += 1
            prefixes = [self._prefixes[int(i)] for i in unique]
            table = self._block_table([p.blocks for p in prefixes])
            lengths = torch.tensor([p.length for p in prefixes], device=device)
            self._groups = (
                torch.as_tensor(active, device=device),
                table,
                self._length_mask(lengths, table.shape[1])[torch.as_tensor(rows, device=device)],
                torch.as_tensor(rows, device=device),
                torch.as_tensor(members, device=device),
                int(counts.max()),
            )
        slots, prefix_table, prefix_mask, group, member, width = self._groups
        count = -(-int(own_len.max()) // size)
        own_table = self._own_table[slots, :count]
        lengths = torch.as_tensor(own_len, device=device)
        mask = torch.cat([prefix_mask, self._length_mask(lengths, count)], dim=1)
        last = lengths - 1
        column, offset = last // size, last % size
        blocks = own_table.gather(1, column[:, None])[:, 0]
        layout = self._own_layout
        if layout is None or layout[0] is not self._groups or layout[1] != count:
            layout = self._own_layout = (self._groups, count, object())
        sequences = torch.arange(len(own_len), device=device)
        batch = _DecodeBatch(
            own_table=own_table,
            mask=mask[:, None, None],
            write=self.cache.write_index(blocks, offset),
            own_key=layout[2],
            own_write=self.cache.write_index(sequences * count + column, offset),
            prefix_table=prefix_table,
            group=group,
            member=member,
            width=width,
        )
        return slots, batch

    def _length_mask(self, lengths: torch.Tensor, count: int) -> torch.Tensor:
        """[N, count * block]: 0 at the first lengths[i] tokens of row i's blocks, the most
        negative value of the model's dtype after (added to attention scores)."""
        positions = torch.arange(count * self.block_size, device=self.device)
        mask = torch.zeros(len(lengths), len(positions), dtype=self.dtype, device=self.device)
        return mask.masked_fill_(positions >= lengths[:, None], torch.finfo(self.dtype).min)

    def _sample_and_record(self, logits: torch.Tensor, slots: torch.Tensor) -> list[RequestOutput]:
        """Sample one token per row of logits for `slots`, append it, finish what is done."""
        if len(self._never):
            logits[:, self._never] = float("-inf")
        counts = self._flag_counts
        columns = self._num_generated[slots]
        params = BatchSampling(
            inv_temperature=self._inv_temperature[slots],
            top_k=self._top_k[slots],
            top_p=self._top_p[slots],
            greedy=self._greedy[slots],
            uniform=self._uniform[slots, columns],
            max_top_k=int(self._top_k_host.max()) if counts["top_k"] else 0,
            use_top_p=counts["top_p"] > 0,
            any_greedy=counts["greedy"] > 0,
        )
        if counts["penalty"]:
            assert self._seen is not None
            params = replace(
                params, repetition_penalty=self._penalty[slots], seen=self._seen[slots]
            )
        tokens, logprobs = sample(logits, params)
        if counts["penalty"]:
            assert self._seen is not None
            self._seen[slots, tokens] = True
        self._out_tokens[slots, columns] = tokens
        self._out_logprobs[slots, columns] = logprobs
        self._last_token[slots] = tokens
        active = self._active[slots]
        generated = columns + active
        self._num_generated[slots] = generated
        hit_stop = (self._stop_ids[slots] == tokens[:, None]).any(dim=-1)
        done = (hit_stop | (generated >= self._max_new[slots])) & active
        # The one device->host sync of the step.
        done_rows = done.nonzero().view(-1)
        finished = slots[done_rows].tolist()
        reasons: list[FinishReason] = [
            "stop" if s else "length" for s in hit_stop[done_rows].tolist()
        ]
        if counts["stop"]:
            self._check_stop_strings(slots.tolist(), finished, reasons)
        if any(self._continues(slot) for slot in finished):
            finished, reasons = self._park(finished, reasons)
        return self._complete(finished, reasons)
