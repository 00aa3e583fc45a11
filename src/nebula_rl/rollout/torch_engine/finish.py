"""How a `TorchEngine`'s samples end: stop strings checked on the host, finished slots turned
into completions (tokens, log-probs, the versions that sampled them) and freed with their
blocks, and a request's output once its last sample is done."""

from __future__ import annotations

import heapq

import torch

from nebula_rl.rollout.engine import (
    Completion,
    FinishReason,
    RequestOutput,
    version_changes_for,
)
from nebula_rl.rollout.torch_engine.state import _EngineState, _RequestState, _Sequence


class _Finishing(_EngineState):
    """Finished samples: completions, freed slots and blocks, finished requests."""

    def _version_changes(self, seq: _Sequence, num: int) -> tuple[tuple[int, int], ...]:
        """The (token index, version) change points of `seq`'s `num` tokens."""
        if not seq.segments:
            return version_changes_for(self._version_log, seq.first_step, num)
        starts = [(0, seq.first_step, 0), *seq.segments]
        ends = [start for start, _, _ in seq.segments] + [num]
        changes: list[tuple[int, int]] = []
        for (start, step, held), end in zip(starts, ends, strict=True):
            count = max(1, end - start - held)
            for offset, version in version_changes_for(self._version_log, step, count):
                if not changes or changes[-1][1] != version:
                    changes.append((start + offset + (held if offset else 0), version))
        return tuple(changes)

    def _check_stop_strings(
        self,
        slots: list[int],
        finished: list[int],
        reasons: list[FinishReason],
    ) -> None:
        """Host-side stop-string check, only for sequences whose request has stop strings.

        A stop string completed by the last token of max_tokens makes the reason "stop", as a
        stop token does.
        """
        position = {slot: row for row, slot in enumerate(finished)}
        candidates = [
            (slot, seq)
            for slot in slots
            if (seq := self._seqs[slot]) is not None
            and seq.stop
            and (slot not in position or reasons[position[slot]] != "stop")
        ]
        if not candidates:
            return
        lengths = [self._num_tokens(slot) for slot, _ in candidates]
        index = torch.tensor([slot for slot, _ in candidates], device=self.device)
        rows = self._out_tokens[index, : max(lengths)].tolist()  # one device->host copy
        for (slot, seq), row, num in zip(candidates, rows, lengths, strict=True):
            window = max(len(s) for s in seq.stop) + 2  # tokens; each decodes to >= 1 char
            text = self.tokenizer.decode(row[max(0, num - window) : num])
            if not any(s in text for s in seq.stop):
                continue
            if slot in position:
                reasons[position[slot]] = "stop"
            else:
                finished.append(slot)
                reasons.append("stop")

    def _complete(self, slots: list[int], reasons: list[FinishReason]) -> list[RequestOutput]:
        """Turn finished slots into completions, free the slots; return finished requests."""
        if not slots:
            return []
        seqs = [self._seqs[s] for s in slots]
        assert all(seq is not None for seq in seqs), "finished slots are occupied"
        lengths = [self._num_tokens(s) for s in slots]
        for slot in slots:
            self._parked.pop(slot, None)  # (aborted while waiting for its continuation)
        index = torch.as_tensor(slots, device=self.device)
        width = max(lengths)
        tokens = self._out_tokens[index, :width].tolist()
        logprobs = self._out_logprobs[index, :width].tolist()
        self._active[index] = False
        self._pos[index] = 0
        self._num_generated[index] = 0
        outputs = []
        for row, (slot, seq, reason, num) in enumerate(
            zip(slots, seqs, reasons, lengths, strict=True)
        ):
            assert seq is not None
            state = seq.state
            state.completions[seq.index] = Completion(
                state.request.request_id,
                seq.index,
                tokens[row][:num],
                logprobs[row][:num],
                reason,
                self._version_changes(seq, num),
                tuple(seq.observations),
            )
            self._release(slot)
            state.slots.discard(slot)
            state.num_done += 1
            if state.num_done == state.request.n:
                del self._requests[state.request.request_id]
                outputs.append(self._output(state))
        return outputs

    def _release(self, slot: int) -> None:
        seq = self._seqs[slot]
        assert seq is not None
        self._count_flags(seq.state.request, -1)
        self._seqs[slot] = None
        self._active_host[slot] = False
        self._pos_host[slot] = 0
        self._top_k_host[slot] = 0
        self._give_back(slot)

    def _give_back(self, slot: int) -> None:
        """Free the slot, its blocks and what was promised to it; its prompt's blocks when it
        was the prompt's last reader."""
        self.cache.give_back(self._own_blocks[slot])
        self._own_blocks[slot] = []
        self.cache.unreserve(int(self._promised[slot]))
        self._promised[slot] = 0
        prefix = self._prefixes[int(self._prefix_of[slot])]
        prefix.users -= 1
        if prefix.users == 0:
            self.cache.give_back(prefix.blocks)
            del self._prefixes[int(self._prefix_of[slot])]
        self._groups = None
        heapq.heappush(self._free, slot)

    @staticmethod
    def _output(state: _RequestState) -> RequestOutput:
        completions = [c for c in state.completions if c is not None]
        assert len(completions) == state.request.n, "every sample has finished"
        request = state.request
        return RequestOutput(request.request_id, tuple(request.prompt_token_ids), completions)
