"""Admission in a `TorchEngine`: waiting samples move into free slots as the cache's free
blocks hold their whole completions, their prompts are prefilled together (or one in chunks,
with `chunked_prefill`), and each slot's sampling parameters are set."""

from __future__ import annotations

import heapq

import torch

from nebula_rl.rollout.engine import GenerationRequest, RequestOutput
from nebula_rl.rollout.multimodal import PromptEmbeddings, embed_prompts
from nebula_rl.rollout.torch_engine.decode import _Decoding
from nebula_rl.rollout.torch_engine.fused import _FusedForward
from nebula_rl.rollout.torch_engine.state import _Admission, _Chunking, _Prefix, _Sequence


class _Admitting(_Decoding):
    """Admitting waiting samples, prefilling their prompts and starting them."""

    def _admit(self) -> list[RequestOutput]:
        """Move waiting samples into free slots, as many as the cache's free blocks hold with
        their whole completions (so decoding never runs out of blocks), prefill their prompts,
        sample first tokens."""
        entries: list[_Admission] = []
        num_tokens, size = 0, self.block_size
        while self._waiting and self._free:
            state = self._waiting[0]
            request = state.request
            length = len(request.prompt_token_ids)
            chunked = (
                self.chunked_prefill
                and length > self.max_num_batched_tokens
                and request.media is None
            )
            if entries and (chunked or num_tokens + length > self.max_num_batched_tokens):
                break
            prompt_blocks, per_sample = (
                -(-length // size),
                -(-self._completion_room(request) // size),
            )
            fits = (self.cache.num_free - prompt_blocks) // per_sample
            take = min(request.n - state.next_index, len(self._free), fits)
            if take < 1:
                break  # (blocks come back as running sequences finish)
            self.cache.reserve(prompt_blocks + take * per_sample)
            slots = [heapq.heappop(self._free) for _ in range(take)]
            self._promised[slots] = per_sample
            entry = (state, list(range(state.next_index, state.next_index + take)), slots)
            state.next_index += take
            if state.next_index == request.n:
                self._waiting.popleft()
            if chunked:
                self._chunking.append(_Chunking(entry, self._new_prefix(length, take)))
                return self._prefill_chunk()
            entries.append(entry)
            num_tokens += length
        if not entries:
            return []
        # Prefill prompts of similar lengths together, so padding wastes at most ~25% compute.
        entries.sort(key=lambda e: len(e[0].request.prompt_token_ids))
        outputs, group = [], [entries[0]]
        for entry in entries[1:]:
            real = sum(len(e[0].request.prompt_token_ids) for e in group)
            padded = len(entry[0].request.prompt_token_ids) * (len(group) + 1)
            if padded > 1.25 * (real + len(entry[0].request.prompt_token_ids)):
                outputs += self._prefill(group)
                group = []
            group.append(entry)
        return outputs + self._prefill(group)

    def _new_prefix(self, length: int, users: int) -> int:
        """Take the reserved blocks of a prompt of `length` tokens; its id."""
        key = self._next_prefix
        self._next_prefix += 1
        self._prefixes[key] = _Prefix(self.cache.take(-(-length // self.block_size)), length, users)
        return key

    def _prefill(self, group: list[_Admission]) -> list[RequestOutput]:
        """Prefill the prompts of `group` together (each once, whatever its samples), start
        their samples."""
        prefixes = [
            self._new_prefix(len(state.request.prompt_token_ids), len(slots))
            for state, _, slots in group
        ]
        longest = max(len(state.request.prompt_token_ids) for state, _, _ in group)
        prompts = torch.zeros(len(group), longest, dtype=torch.long)
        for row, (state, _, _) in enumerate(group):
            ids = state.request.prompt_token_ids
            prompts[row, : len(ids)] = torch.tensor(ids)
        last = torch.tensor([len(s.request.prompt_token_ids) - 1 for s, _, _ in group])
        slots_t, source = self._activate(group, prefixes)
        prompts, last = prompts.to(self.device), last.to(self.device)
        embedded = self._embed_media(group, prompts, last + 1, slots_t, source)
        # (the longest prompt's blocks set the width: the padding of shorter ones goes to block 0)
        table = self._block_table([self._prefixes[p].blocks for p in prefixes])
        logits = self._forward.prefill(prompts, last, table, 0, None, embedded)
        return self._sample_first(logits, slots_t, source, len(group))

    def _prefill_chunk(self) -> list[RequestOutput]:
        """The next chunk of the prompt being prefilled in chunks; its samples start after the
        last chunk."""
        chunking = self._chunking[0]
        state, _, _ = chunking.entry
        ids = state.request.prompt_token_ids
        size = self.block_size
        step = max(size, self.max_num_batched_tokens // size * size)
        start, end = chunking.done, min(len(ids), chunking.done + step)
        blocks = self._prefixes[chunking.prefix].blocks
        tokens = torch.tensor([ids[start:end]], device=self.device)
        table = torch.tensor([blocks[start // size : -(-end // size)]], device=self.device)
        past = torch.tensor([blocks[: start // size]], device=self.device) if start else None
        last = torch.tensor([end - start - 1], device=self.device)
        logits = self._forward.prefill(tokens, last, table, start, past)
        chunking.done = end
        if end < len(ids):
            return []
        self._chunking.popleft()
        slots_t, source = self._activate([chunking.entry], [chunking.prefix])
        self._rope_delta[slots_t] = 0
        return self._sample_first(logits, slots_t, source, 1)

    def _activate(
        self, group: list[_Admission], prefixes: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Set up the slots of `group` (prefilled prompts `prefixes`) to decode: their slots,
        and for each the row of its prompt in the group."""
        all_slots, source, prompt_len, top_k, uniforms = [], [], [], [], []
        for row, ((state, indices, slots), prefix) in enumerate(zip(group, prefixes, strict=True)):
            request = state.request
            for index, slot in zip(indices, slots, strict=True):
                all_slots.append(slot)
                source.append(row)
                prompt_len.append(len(request.prompt_token_ids))
                top_k.append(
                    request.sampling.top_k if request.sampling.top_k < self.vocab_size else 0
                )
                self._seqs[slot] = _Sequence(state, index, self._step_count, request.sampling.stop)
                self._prefix_of[slot] = prefix
                state.slots.add(slot)
                self._count_flags(request, +1)
            uniforms.append(self._draw_uniforms(request, indices))
        slots_t = torch.tensor(all_slots, device=self.device)
        lengths = torch.tensor(prompt_len, device=self.device)
        self._set_slot_params(group, slots_t, lengths, torch.cat(uniforms))
        self._mark_prompt_tokens(group)
        self._active_host[all_slots] = True
        self._pos_host[all_slots] = prompt_len
        self._prompt_len_host[all_slots] = prompt_len
        self._top_k_host[all_slots] = top_k
        self._groups = None
        return slots_t, source

    def _sample_first(
        self, logits: torch.Tensor, slots: torch.Tensor, source: list[int], num_prompts: int
    ) -> list[RequestOutput]:
        """First tokens of `slots` from their prompts' logits (row source[i] for slot i)."""
        if len(source) > num_prompts:  # (a prompt's samples share its logits)
            logits = logits[torch.tensor(source, device=self.device)]
        return self._sample_and_record(logits, slots)

    def _embed_media(
        self,
        group: list[_Admission],
        prompts: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        source: list[int],
    ) -> PromptEmbeddings | None:
        """The group's prompt embeddings when one of them holds media (else None: text is
        embedded by the forward), and its slots' rotary offsets."""
        if not self.multimodal:
            return None
        media = [state.request.media for state, _, _ in group]
        if all(m is None for m in media):
            self._rope_delta[slots] = 0
            return None
        embedded = embed_prompts(self.model, prompts, lengths, media)
        self._rope_delta[slots] = embedded.deltas[torch.tensor(source, device=self.device)]
        if isinstance(self._forward, _FusedForward):
            self._forward.rope_room(self.max_model_len + max(0, int(embedded.deltas.max())))
        return embedded

    def _mark_prompt_tokens(self, group: list[_Admission]) -> None:
        """For requests with a repetition penalty: their slots' seen tokens are the prompt's."""
        penalised = [e for e in group if e[0].request.sampling.repetition_penalty != 1]
        if not penalised:
            return
        if self._seen is None:
            self._seen = torch.zeros(
                self.max_num_seqs, self.vocab_size, dtype=torch.bool, device=self.device
            )
        for state, _, slots in penalised:
            index = torch.tensor(slots, device=self.device)
            prompt = torch.tensor(state.request.prompt_token_ids, device=self.device)
            self._seen[index] = False
            self._seen[index[:, None], prompt[None, :]] = True

    def _draw_uniforms(self, request: GenerationRequest, indices: list[int]) -> torch.Tensor:
        """The uniforms each sample will sample its tokens with, [len(indices), max_model_len]."""
        shape = (len(indices), self.max_model_len)
        if request.sampling.seed is None:
            return torch.rand(shape, generator=self._generator, device=self.device)
        rows = []
        for index in indices:
            generator = torch.Generator(device=self.device).manual_seed(
                request.sampling.seed + index
            )
            rows.append(torch.rand(shape[1:], generator=generator, device=self.device))
        return torch.stack(rows)

    def _set_slot_params(
        self,
        batch: list[_Admission],
        slots: torch.Tensor,
        lengths: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> None:
        inv_temperature, top_k, top_p, greedy, max_new, stops = [], [], [], [], [], []
        penalty = []
        for state, indices, _ in batch:
            sampling = state.request.sampling
            room = self.max_model_len - len(state.request.prompt_token_ids)
            stop = list(sampling.stop_token_ids) + (
                [] if sampling.ignore_eos else list(self.eos_token_ids)
            )
            for _ in indices:
                inv_temperature.append(
                    1.0 / sampling.temperature if sampling.temperature > 0 else 1.0
                )
                top_k.append(
                    sampling.top_k if 0 < sampling.top_k < self.vocab_size else self.vocab_size
                )
                top_p.append(sampling.top_p)
                greedy.append(sampling.temperature == 0)
                penalty.append(sampling.repetition_penalty)
                max_new.append(min(sampling.max_tokens, room))
                stops.append(stop)
        width = max(1, *(len(s) for s in stops))
        if width > self._stop_ids.shape[1]:  # rare: grow the stop-id table
            grown = torch.full((self.max_num_seqs, width), -1, dtype=torch.long, device=self.device)
            grown[:, : self._stop_ids.shape[1]] = self._stop_ids
            self._stop_ids = grown
        stop_rows = torch.full((len(stops), self._stop_ids.shape[1]), -1, dtype=torch.long)
        for row, stop in enumerate(stops):
            stop_rows[row, : len(stop)] = torch.tensor(stop, dtype=torch.long)
        device = self.device
        self._inv_temperature[slots] = torch.tensor(inv_temperature, device=device)
        self._top_k[slots] = torch.tensor(top_k, device=device)
        self._top_p[slots] = torch.tensor(top_p, device=device)
        self._greedy[slots] = torch.tensor(greedy, device=device)
        self._penalty[slots] = torch.tensor(penalty, device=device)
        self._max_new[slots] = torch.tensor(max_new, device=device)
        self._stop_ids[slots] = stop_rows.to(device)
        self._uniform[slots] = uniforms
        self._pos[slots] = lengths
        self._num_generated[slots] = 0
        self._active[slots] = True
