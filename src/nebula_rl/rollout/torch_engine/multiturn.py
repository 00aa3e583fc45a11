"""Multi-turn sampling in a `TorchEngine` (`GenerationRequest.continuation`): a sample that
stops is parked, its blocks kept, until its continuation answers; the observation then runs
through the model in one forward over the sample's cached tokens, and the sample decodes on."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

import torch

from nebula_rl.rollout.engine import FinishReason, RequestOutput
from nebula_rl.rollout.torch_engine.finish import _Finishing
from nebula_rl.rollout.torch_engine.fused import _Past


class _MultiTurn(_Finishing):
    """Parking samples for their continuation, and resuming them with its observation."""

    def _continues(self, slot: int) -> bool:
        seq = self._seqs[slot]
        return seq is not None and seq.state.request.continuation is not None

    def _park(
        self, finished: list[int], reasons: list[FinishReason]
    ) -> tuple[list[int], list[FinishReason]]:
        """Hand the samples that stopped and have a continuation their tokens, take them out of
        the decode batch (blocks kept); the finished slots and reasons that remain."""
        keep_slots: list[int] = []
        keep_reasons: list[FinishReason] = []
        for slot, reason in zip(finished, reasons, strict=True):
            seq = self._seqs[slot]
            continuation = None if seq is None else seq.state.request.continuation
            if reason != "stop" or seq is None or continuation is None:
                keep_slots.append(slot)
                keep_reasons.append(reason)
                continue
            tokens = self._out_tokens[slot, : self._num_tokens(slot)].tolist()
            self._parked[slot] = continuation(seq.index, tokens)
            self._active_host[slot] = False
            self._active[slot] = False
            self._groups = None
        return keep_slots, keep_reasons

    def _answered(self) -> list[tuple[int, list[int] | None]]:
        """The parked samples whose continuation has answered, taken out of the parked ones,
        with their answers (waiting a moment for one when nothing else can run)."""
        if not self._parked:
            return []
        ready = [slot for slot, future in self._parked.items() if future.done()]
        if not ready and not self._active_host.any() and not (self._waiting and self._free):
            wait(list(self._parked.values()), timeout=0.005, return_when=FIRST_COMPLETED)
            ready = [slot for slot, future in self._parked.items() if future.done()]
        return [(slot, self._parked.pop(slot).result()) for slot in ready]

    def _resume(self, answered: list[tuple[int, list[int] | None]]) -> list[RequestOutput]:
        """Samples whose continuation answered (slot, observation): append the observation and
        decode on, or finish ("length" when the observation and one more token do not fit)."""
        finished: list[int] = []
        reasons: list[FinishReason] = []
        for slot, observation in answered:
            seq = self._seqs[slot]
            assert seq is not None
            num = self._num_tokens(slot)
            request = seq.state.request
            room = min(request.sampling.max_tokens, self._completion_room(request))
            if not observation or num + len(observation) >= room:
                finished.append(slot)
                reasons.append("length" if observation else "stop")
                continue
            bad = [t for t in observation if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"an observation's token id {bad[0]} is outside the vocabulary")
            self._extend(slot, num, observation)
            seq.segments.append((num, self._step_count, len(observation)))
            seq.observations.append((num, num + len(observation)))
            self._active_host[slot] = True
            self._active[slot] = True
            self._groups = None
        return self._complete(finished, reasons)

    def _extend(self, slot: int, num: int, observation: list[int]) -> None:
        """Append `observation` to slot `slot`'s `num` tokens: one forward writes the keys and
        values of its last token and all but the observation's last (the one decode reads
        next, in this same step) into its own blocks; the observation is recorded with
        log-prob 0."""
        size, length, device = self.block_size, len(observation), self.device
        written = int(self._pos_host[slot] - self._prompt_len_host[slot])  # (own tokens cached)
        held, needed = len(self._own_blocks[slot]), -(-(written + length) // size)
        if needed > held:
            blocks = self.cache.take(needed - held)
            self._promised[slot] -= needed - held
            self._own_blocks[slot] += blocks
            self._own_table[slot, held:needed] = torch.tensor(blocks, device=device)
        appended = torch.tensor(observation, device=device)
        tokens = torch.cat([self._last_token[slot : slot + 1], appended[:-1]])
        index = torch.arange(written, written + length, device=device)
        write = self.cache.write_index(self._own_table[slot, index // size], index % size)
        positions = self._pos[slot] + torch.arange(length, device=device)
        prefix = self._prefixes[int(self._prefix_of[slot])]
        past = _Past(
            torch.tensor([prefix.blocks], device=device),
            prefix.length,
            self._own_table[slot : slot + 1, :needed],
            written + length,
        )
        rope = positions + self._rope_delta[slot] if self.multimodal else None
        self._forward.extend(tokens, positions, write, past, rope)
        self._out_tokens[slot, num : num + length] = appended
        self._out_logprobs[slot, num : num + length] = 0.0
        if self._seen is not None and self._flag_counts["penalty"]:
            self._seen[slot, appended] = True
        self._num_generated[slot] = num + length
        self._last_token[slot] = appended[-1]
        self._pos[slot] += length
        self._pos_host[slot] += length
