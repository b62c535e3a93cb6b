"""Built-in synthetic data with Criteo's shape (or another model's), so the main job needs
no files.

13 dense features (log(1 + count) of geometric counts) and 26 categorical features (or as
many of each as a model of other tables and inputs has, :class:`SyntheticCriteo`) whose ids
follow a power law (Zipf, exponent ``alpha``) over each table's size, like real click logs
where a few ids are looked up in almost every batch. Labels come from a fixed hidden
"teacher": a logistic model with one weight per (table, id), a linear term
in the dense features and a few pairwise factor interactions (what DLRM's dot-product
interaction can represent), with a bias giving Criteo's click rate of about 0.25.

The teacher's parameters are derived by hashing (seed, table, id), never stored, so a
table of ten million ids costs nothing. Every batch is a pure function of
(seed, step), which makes every rank of a distributed job read the same global batch
and makes resumed runs see the data they would have seen; and every value of a batch is
drawn at its own place in a counter-based stream, so a rank makes only the part of the
global batch it reads (its samples, and its tables' ids of the others).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recsz.data.criteo import N_DENSE, Arrays

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finalizer: a good 64-bit hash of uint64 arrays."""
    z = x.astype(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _hash_normal(key: np.ndarray) -> np.ndarray:
    """Standard normal values that are a deterministic function of uint64 keys."""
    a = _splitmix64(key)
    b = _splitmix64(a ^ np.uint64(0x5851F42D4C957F2D))
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    u2 = (b >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


#: Tables of at most this many rows may keep their teacher's values (8 bytes a row and
#: value: 2 MiB, at most 90 values a generator); larger ones hash each id asked.
CACHED_ROWS = 1 << 18


class SyntheticCriteo:
    """Criteo-shaped samples with a learnable hidden teacher; deterministic per seed.

    Args:
        table_sizes: rows of each table, a categorical feature each (Criteo's 26, or any
            other count; id 0 stays "missing", never drawn).
        seed: selects the teacher and the sample stream.
        n_dense: dense features a sample (Criteo's 13, or any other count >= 1).
        alpha: Zipf exponent of id frequencies (about 1.05-1.2 on real click logs).
        shuffle_labels: draw labels independently of the features (a control whose AUC
            must stay at 0.5).
        cached_rows: tables up to this size keep their teacher's values (0: none;
            default :data:`CACHED_ROWS`).
    """

    n_pairs = 8  # pairwise factor interactions in the teacher
    factor_dim = 4

    def __init__(
        self,
        table_sizes: Sequence[int],
        seed: int = 0,
        alpha: float = 1.1,
        shuffle_labels: bool = False,
        cached_rows: int | None = None,
        n_dense: int = N_DENSE,
    ) -> None:
        if not len(table_sizes) or min(table_sizes) < 2:
            raise ValueError("every table needs at least 2 rows (row 0 means missing)")
        if n_dense < 1:
            raise ValueError(f"need a dense feature or more, got {n_dense}")
        self.table_sizes = [int(n) for n in table_sizes]
        self.n_cat, self.n_dense = len(self.table_sizes), int(n_dense)
        self.seed = int(seed)
        self.alpha = float(alpha)
        self.shuffle_labels = shuffle_labels
        rng = np.random.default_rng([self.seed, 7])
        self.dense_w = rng.normal(0.0, 0.25, self.n_dense)
        self.dense_p = rng.uniform(0.05, 0.6, self.n_dense)  # geometric count parameters
        pairs = rng.choice(self.n_cat, size=(self.n_pairs, 2), replace=True)
        self.pairs = [(int(a), int(b)) for a, b in pairs if a != b]
        # Per-table weight scale: small tables (frequent ids) carry more signal, as in
        # real logs where e.g. the device type matters and rare ids barely do.
        self.table_scale = np.array([0.6 if n < 2000 else 0.35 for n in self.table_sizes])
        self._tables: dict[tuple[int, int], np.ndarray] = {}  # (table, value): all rows'
        self._asked: dict[tuple[int, int], int] = {}  # ids hashed so far
        self.cached_rows = CACHED_ROWS if cached_rows is None else cached_rows
        self.bias = self._calibrate_bias()

    # ---- ids ------------------------------------------------------------------------
    def _ids(self, t: int, u: np.ndarray) -> np.ndarray:
        """Table ``t``'s ids in [1, size) with power-law frequencies, from uniforms ``u``."""
        m = self.table_sizes[t] - 1  # distinct ids available
        a = self.alpha
        # Inverse CDF of the continuous power law on [1, m + 1), floored to a rank.
        k = ((((m + 1.0) ** (1.0 - a) - 1.0) * u + 1.0) ** (1.0 / (1.0 - a))).astype(np.int64)
        k = np.clip(k, 1, m)
        # Scatter popular ranks over the table so hot rows are not all at the top.
        return 1 + ((k - 1) * 2654435761 + t * 97) % m

    # ---- teacher --------------------------------------------------------------------
    def _table_key(self, t: int, ids: np.ndarray, k: int) -> np.ndarray:
        base = (self.seed * 1_000_003 + t * 131 + k) & 0xFFFFFFFF
        return ids.astype(np.uint64) * np.uint64(0x100000001B3) ^ np.uint64(base << 20)

    def _value(self, t: int, ids: np.ndarray, k: int) -> np.ndarray:
        """The teacher's value ``k`` of table ``t`` at ``ids``: hashed for each id, or, once
        a table of at most ``cached_rows`` rows has had as many ids asked as it has rows,
        read from all its rows' values, hashed then (the same numbers: a value is a
        function of its key alone; benchmarks/README.md, "Making the batches")."""
        size = self.table_sizes[t]
        table = self._tables.get((t, k))
        if table is None and size <= self.cached_rows:
            asked = self._asked[(t, k)] = self._asked.get((t, k), 0) + len(ids)
            if asked >= size:  # filling costs no more than the hashing done so far
                table = _hash_normal(self._table_key(t, np.arange(size), k))
                self._tables[(t, k)] = table
        if table is None:
            return _hash_normal(self._table_key(t, ids, k))
        return table[ids]

    def logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The teacher's logit for each sample (without the label noise)."""
        z = np.full(ids.shape[0], self.bias)
        z += (dense.astype(np.float64) - 0.7) @ self.dense_w
        for t in range(self.n_cat):
            z += self.table_scale[t] * self._value(t, ids[:, t], 0)
        for a, b in self.pairs:
            fa = np.stack([self._value(a, ids[:, a], 1 + k) for k in range(self.factor_dim)])
            fb = np.stack([self._value(b, ids[:, b], 1 + k) for k in range(self.factor_dim)])
            z += 0.35 * (fa * fb).sum(0) / np.sqrt(self.factor_dim)
        return z

    def _calibrate_bias(self) -> float:
        """Pick the bias so that about a quarter of the samples are clicks (as in Criteo)."""
        self.bias = 0.0
        blk = self.block(_CALIBRATION, 0, 4096)
        z = self.logits(blk.dense, blk.cats)
        lo, hi = -10.0, 10.0
        for _ in range(40):
            mid = (lo + hi) / 2
            p = 1.0 / (1.0 + np.exp(-(z + mid)))
            lo, hi = (mid, hi) if p.mean() < 0.25 else (lo, mid)
        return (lo + hi) / 2

    # ---- public ---------------------------------------------------------------------
    def block(
        self,
        stream: int,
        index: int,
        n: int,
        rows: slice | None = None,
        tables: Sequence[int] = (),
        span: slice | None = None,
    ) -> Arrays:
        """Samples of block ``index`` of ``stream`` (0 = train, 1 = eval); pure function.

        With ``span`` (a run of the ``n`` samples), only those samples, the evaluation
        set's batches (one block, whatever the batches' size). With ``rows`` (a slice of
        the samples made), only those samples are made in full and, of the others, only
        the ids of ``tables``; every other entry is 0 (one rank's part of a global batch:
        :class:`recsz.data.source.Part`). Each value is the same whatever part or span it
        is made in: it is drawn at its own place in the block's counter-based stream
        (table t's ids at t * n + sample, then the counts row by row, then the labels'
        draws), which a part enters where its values start.
        """
        first, end, step = (span or slice(0, n)).indices(n)
        m = end - first
        a, b, step2 = (rows or slice(0, m)).indices(m)
        if step != 1 or step2 != 1 or b < a or m < 0:
            raise ValueError(f"rows {rows} of {span} is not a run of the block's {n} samples")
        draws, cats, nd = _Draws(self.seed, stream, index), self.n_cat, self.n_dense
        ids = np.zeros((m, cats), dtype=np.int64)
        dense = np.zeros((m, nd), dtype=np.float32)
        labels = np.zeros(m, dtype=np.float32)
        at_dense, at_labels = cats * n + first * nd, (cats + nd) * n + first
        whole = (a, b) == (0, m)
        u_all = draws.uniform(0, (cats + nd + 1) * n) if whole and m == n else None
        for t in range(cats):
            lo, hi = (0, m) if whole or t in tables else (a, b)
            u = draws.uniform(t * n + first + lo, t * n + first + hi, u_all)
            ids[lo:hi, t] = self._ids(t, u)
        u = draws.uniform(at_dense + a * nd, at_dense + b * nd, u_all)
        counts = np.floor(np.log1p(-u.reshape(-1, nd)) / np.log1p(-self.dense_p))
        dense[a:b] = np.log1p(counts)  # geometric counts, by inversion
        if self.shuffle_labels:
            p = np.full(b - a, 0.25)
        else:
            p = 1.0 / (1.0 + np.exp(-self.logits(dense[a:b], ids[a:b])))
        labels[a:b] = draws.uniform(at_labels + a, at_labels + b, u_all) < p
        return Arrays(dense, ids, labels)


_CALIBRATION = 2  # the stream the teacher's bias is calibrated on (0 train, 1 eval)


class _Draws:
    """The uniforms of one block: a PCG64 stream keyed by (seed, stream, block), entered
    anywhere in O(log n) (``advance``), so a part of a block draws only its own values."""

    def __init__(self, seed: int, stream: int, index: int) -> None:
        self._bits = np.random.PCG64([seed, stream, index])
        self._start = self._bits.state

    def uniform(self, lo: int, hi: int, drawn: np.ndarray | None = None) -> np.ndarray:
        """Draws [lo, hi) of the stream: uniforms in [0, 1) (a view of ``drawn``, the
        stream's first draws, where given)."""
        if drawn is not None:
            return drawn[lo:hi]
        self._bits.state = self._start
        self._bits.advance(lo)
        return np.random.Generator(self._bits).random(hi - lo)
