"""Raw Criteo files as an evaluation set alone, streamed: ``recsz evaluate --eval-data``
and ``recsz predict`` on text files (plain or gzipped) of any size.

Each evaluation parses the files again, block by block (:func:`recsz.data.criteo.iter_blocks`,
a batch's rows at a time), so a rank holds one batch of them at a time, never the set: a
held-out day of Terabyte (~180 million lines) is scored without preprocessing it first.
Every rank reads every row (the table owners need every sample's ids).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from recsz.data import criteo
from recsz.data.source import Batch, DataSource, Part, to_batch


class RawStream(DataSource):
    """Raw Criteo files, read in order, as a held-out set (no training rows); ``labeled``
    False: Criteo's test layout (39 fields, no label: the batches' labels NaN)."""

    def __init__(
        self,
        paths: Sequence[str],
        table_sizes: Sequence[int],
        skip_bad_lines: bool = False,
        labeled: bool = True,
        n_dense: int = criteo.N_DENSE,
    ) -> None:
        instead = ("score it on TorchRec-layout .npy days of its shape (`recsz predict RUN "
                   "DIR`; labeled: `recsz evaluate RUN --eval-data DIR`, with --predictions "
                   "FILE for the scores)")  # fmt: skip
        for p in paths:
            if not Path(p).is_file():
                raise FileNotFoundError(f"{p}: no such file")
        criteo.check_layout(", ".join(map(str, paths)), len(table_sizes), n_dense, instead)
        self.paths = list(paths)
        self.table_sizes = list(table_sizes)
        self.skip_bad_lines = skip_bad_lines
        self.labeled = labeled
        self.name = ", ".join(self.paths)
        self.n_train = 0

    def train_batch(self, step: int, batch_size: int, part: Part | None = None) -> Batch:
        raise ValueError(f"{self.name}: a held-out set alone has no training rows")

    def eval_batches(self, batch_size: int, part: Part | None = None) -> Iterator[Batch]:
        stats = criteo.ParseStats()
        for p in self.paths:
            for blk in criteo.iter_blocks(
                p, self.table_sizes, batch_size, self.skip_bad_lines, stats, labeled=self.labeled
            ):
                yield to_batch(blk)
        self.skipped_lines = stats.skipped
        if stats.skipped:
            print(f"{self.name}: skipped {stats.skipped} bad lines (first: {stats.first_error})")
