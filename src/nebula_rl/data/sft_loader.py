"""The SFT loop's batches: conversations tokenised on the way, by dataloader workers if asked.

Each step takes `train_batch_per_replica` conversations per data-parallel rank, in the epoch's
seeded order (`epoch_order` with `dataloader_seed`); this rank's are every `dp_size`-th of them.
`dataloader_num_workers` processes tokenise ahead of the step (`dataloader_prefetch_factor`
batches each), as a torch `DataLoader` does; with 0 the loop tokenises in its own process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.utils.data

__all__ = ["SftBatches"]

Example = tuple[Any, ...]
"""A tokenised conversation: (token ids, loss mask), and its media for a vision-language model."""


class _Rows(torch.utils.data.Dataset[Example]):
    def __init__(self, rows: Sequence[dict[str, Any]], tokenize: Callable[[dict], Example]) -> None:
        self.rows, self.tokenize = rows, tokenize

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Example:
        return self.tokenize(self.rows[index])


def _as_list(batch: list[Example]) -> list[Example]:
    return batch


class SftBatches:
    """This rank's examples of the steps from (`epoch`, `start`) on, one list per step."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenize: Callable[[dict[str, Any]], Example],
        *,
        num_workers: int,
        prefetch_factor: int | None,
    ) -> None:
        self.dataset = _Rows(rows, tokenize)
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor

    def epoch(
        self, order: Sequence[int], *, start: int, stop: int, size: int, dp_rank: int, dp_size: int
    ) -> Iterator[tuple[int, list[Example]]]:
        """(position after the step, this rank's examples) for the steps whose first row is at
        `start`, `start + size`, ... below `stop` in `order`."""
        starts = list(range(start, stop, size))
        indices = [list(order[s : s + size])[dp_rank::dp_size] for s in starts]
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=indices,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            collate_fn=_as_list,
        )
        for s, batch in zip(starts, loader, strict=True):
            yield s + size, batch
