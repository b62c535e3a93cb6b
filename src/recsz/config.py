"""Training configuration: one typed dataclass, validated on construction, and where a
run's configuration comes from (flags, a file, the run it resumes).

Each field is declared once, with its default, help and allowed values
(:func:`recsz.fields.opt`), in the groups it inherits (:mod:`recsz.runoptions`,
:mod:`recsz.commoptions`); the `recsz train` command line is built from these fields
(:func:`build_parser`), so a flag, its default and its help cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from recsz.commoptions import DenseCommOptions, ExchangeOptions
from recsz.configcheck import refused
from recsz.fields import blamed, check, flag, parser, read_values
from recsz.model import FiitedSpec, ModelConfig, TTSpec, get_preset
from recsz.model.multihot import parse_hotness
from recsz.model.schedule import LRSchedule
from recsz.model.sharding import column_shards
from recsz.runoptions import JobOptions, ModelOptions

#: The tables' default learning rate with bags, as a share of the preset's: at the preset's
#: the first steps' sums of up to 100 moved rows blew the logits up (bench: AUC 0.62 after 30
#: steps against 0.71 at 0.4x; tiny, 400 steps: 0.713 against 0.731).
BAG_EMB_LR = 0.4
#: The most tables a one-hot model's MLPs start as facebookresearch/dlrm's (more: PyTorch's,
#: as TorchRec's DLRM): bench preset, 100 steps, 3 seeds, PyTorch's won every seed at 40, 60
#: and 100 tables, dlrm's every seed at 8 tables and on Criteo's 26 (benchmarks/bench_mlpinit.py).
DLRM_INIT_MAX_TABLES = 26


def _widths(name: str, text: str) -> tuple[int, ...]:
    """An MLP's widths from their dash-separated text (``512-256-64``)."""
    try:
        widths = tuple(int(w) for w in text.split("-"))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(f"{flag(name)} {text!r}: widths >= 1, dash-separated (512-256-64)")
    return widths


def _table_rows(text: str) -> tuple[int, ...]:
    """``--table-rows``: rows of each table, comma-separated, ``COUNTxROWS`` for several
    alike (``40x1000000,5000``)."""
    rows: list[int] = []
    try:
        for item in text.split(","):
            count, _, each = item.strip().rpartition("x")
            if (n := int(count) if count else 1) < 1:
                raise ValueError(count)
            rows += [int(each)] * n
    except ValueError:
        rows = []
    if not rows or min(rows) < 2:
        raise ValueError(
            f"--table-rows {text!r}: each table's rows (>= 2: row 0 is missing), "
            "comma-separated, COUNTxROWS for several alike (40x1000000,5000)"
        )
    return tuple(rows)


@dataclass
class TrainConfig(JobOptions, DenseCommOptions, ExchangeOptions, ModelOptions):
    """Everything a run depends on (its options' groups in the order of the command line's
    help). ``None`` means "the preset's default"."""

    def model(self) -> ModelConfig:
        """The preset's model with this run's tables, shape and interaction (what it leaves
        None, the preset's); a ValueError names the flag whose shape does not fit."""
        m = get_preset(self.preset).model
        mine: dict[str, Any] = {"interaction": self.interaction, "dcn_layers": self.dcn_layers,
                                "dcn_rank": self.dcn_rank, "emb_dim": self.emb_dim}  # fmt: skip
        sizes = m.table_sizes if self.table_rows is None else _table_rows(self.table_rows)
        if self.max_rows is not None:
            sizes = tuple(min(rows, self.max_rows) for rows in sizes)
        mine["table_sizes"], mine["n_dense"] = sizes, self.dense_features
        if self.emb_dim is not None and self.bottom_mlp is None:  # (it ends in the dim)
            mine["bottom_mlp"] = (*m.bottom_mlp[:-1], self.emb_dim)
        for name in ("bottom_mlp", "top_mlp"):
            if (widths := getattr(self, name)) is not None:
                mine[name] = _widths(name, widths)
        try:
            return replace(m, **{k: v for k, v in mine.items() if v is not None})
        except ValueError as e:
            raise ValueError(f"--emb-dim / --bottom-mlp / --top-mlp: {e}") from None

    def sharded_tables(self) -> tuple[list[int], int]:
        """The tables as the plan, the exchange and the bound policies see them: their rows
        and width (``--column-shards``: each table's shards, :func:`column_shards`)."""
        m = self.model()
        return column_shards(m.table_sizes, m.emb_dim, self.column_shards)

    def tt_spec(self) -> TTSpec | None:
        """The TT-Rec tables: the ``tt_tables`` largest of the preset (None: no TT)."""
        if not self.tt_tables:
            return None
        sizes = self.model().table_sizes
        largest = sorted(range(len(sizes)), key=lambda t: (-sizes[t], t))[: self.tt_tables]
        shape = (self.tt_rank, self.tt_cores, self.tt_init, self.tt_lr)
        cache = (self.tt_cache_rows, self.tt_cache_interval)
        return TTSpec(frozenset(largest), *shape, *cache, self.tt_placement)

    def hotness(self) -> tuple[int, ...] | None:
        """Ids per bag of every table (None: one id, no bags)."""
        return parse_hotness(self.multi_hot, self.model().n_tables)

    def lr_schedule(self) -> LRSchedule:
        """The learning rates' warm-up and decay (constant by default)."""
        return LRSchedule(
            self.lr_warmup_steps, self.lr_decay_start, self.lr_decay_steps, self.lr_decay_power
        )

    def fiited_spec(self) -> FiitedSpec | None:
        """FIITED's pruning of the dense tables (None: not asked for)."""
        if self.fiited_budget is None:
            return None
        f = (self.fiited_budget, self.fiited_chunk, self.fiited_interval, self.fiited_decay)
        return FiitedSpec(*f, self.fiited_rule)

    def failure_at(self) -> tuple[int, int] | None:
        """``--inject-failure`` as (rank, step), or None."""
        if not self.inject_failure:
            return None
        try:
            r, s = self.inject_failure.split(":")
            return int(r), int(s)
        except ValueError:
            raise ValueError(
                f"--inject-failure wants RANK:STEP, got {self.inject_failure!r}"
            ) from None

    @classmethod
    def taking(cls, who: str, taken: set[str], **options: Any) -> TrainConfig:
        """A configuration of ``options`` for ``who``, which reads the fields ``taken``
        only: any other option is refused by name, not dropped silently."""
        if unused := sorted(set(options) - taken):
            ours = {f.name for f in fields(cls)}
            known = "options of `recsz train`" if set(unused) <= ours else "not options"
            raise ValueError(
                f"recsz: {who} does not use {', '.join(unused)} ({known}); it takes "
                f"{', '.join(sorted(taken))}"
            )
        return cls(**options)

    def __post_init__(self) -> None:
        check(self)  # each field's own limits
        refused(self)  # what the fields allow together
        if self.log_every == 0:
            self.log_every = 1

    def resolved(self, name: str) -> Any:
        """A field whose None means a default of its own (``batch_size``, ``lr``, ``emb_lr``,
        ``emb_optimizer``, ``dense_optimizer``: the preset's, ``emb_lr`` scaled with bags
        unless the preset has a rate for them; ``mlp_init``: the data's and the tables'): its
        value or that."""
        v = getattr(self, name)
        if v is not None:
            return v
        if name == "mlp_init":  # measured: benchmarks/README.md, "Multi-hot bags", "MLPs' start"
            few = self.model().n_tables <= DLRM_INIT_MAX_TABLES
            return "dlrm" if self.hotness() is None and few else "torch"
        preset = get_preset(self.preset)
        if name == "emb_lr" and self.hotness() is not None:  # (same section)
            return preset.bags_emb_lr or preset.emb_lr * BAG_EMB_LR
        return getattr(preset, name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
        return cls(**d)


def build_parser(only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The `recsz train` flags: one per TrainConfig field (``only``: these, no defaults),
    and --config."""
    p = parser(TrainConfig, "recsz train", "Train DLRM with a compressed embedding all-to-all.",
               only)  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="a run's directory or config.json, or a "
                   "JSON / TOML (.toml) file of options (batch_size = 4096): flags given "
                   "override it; --out comes from the command line")  # fmt: skip
    return p


def parse_train_args(argv: list[str] | None) -> TrainConfig:
    """`recsz train`'s configuration: each flag of ``argv`` given, else --config's file's
    value, else the field's default."""
    return configured(given_args(sys.argv[1:] if argv is None else argv))


#: what a resumed run never takes from the run it resumes: where it resumes from and
#: writes (its run directory, whatever the saved path said), a test's injected failure, a
#: profile (a measurement, once)
NOT_RESUMED = ("resume", "out", "resume_fallback", "inject_failure", "profile",
               "profile_from", "config_version")  # fmt: skip


def given_args(argv: list[str]) -> dict[str, Any]:
    """The flags ``argv`` gives, by field (parsed, not yet checked together), and
    ``config``: --config's file, if given. Parsed by :func:`build_parser` first, so that
    ``--help`` shows every flag's default and a bad flag is named as `recsz train` names it."""
    build_parser().parse_args(argv)
    names = tuple(f.name for f in fields(TrainConfig) if f.metadata["cli"])
    return vars(build_parser(names).parse_args(argv))


def configured(
    given: dict[str, Any], then: Callable[[dict[str, Any]], dict[str, Any]] = dict
) -> TrainConfig:
    """The flags ``given`` (:func:`given_args`) over the values of their ``config`` file (a
    run's record: the places in :data:`NOT_RESUMED` its own, not taken; elsewhere refused);
    ``then``: what a command makes of those values (`recsz plan`: a batch its ranks split)."""
    given = dict(given)
    if (path := given.pop("config", None)) is None:
        return TrainConfig(**then(given))
    if os.path.isdir(path):  # a run's directory: its record
        path = os.path.join(path, "config.json")
    values = read_values(TrainConfig, path)
    record = values.pop("config_version", None) is not None
    for k in set(NOT_RESUMED) & set(values):
        if values.pop(k) is not None and not record:
            raise ValueError(f"{path}: {k!r} is the command line's ({flag(k)}), not a file's")
    try:
        return TrainConfig.from_dict(then({**values, **given}))
    except ValueError as e:
        raise blamed(e, {k: v for k, v in values.items() if k not in given}, path) from None


def resumed_config(given: dict[str, Any], saved: dict[str, Any]) -> TrainConfig:
    """``recsz train --resume RUN [flags]``: the configuration of the run resumed
    (``saved``) but for the flags ``given`` (a checkpoint then refuses what may not
    change) and :data:`NOT_RESUMED`."""
    kept = {k: v for k, v in saved.items() if k not in NOT_RESUMED}
    return TrainConfig.from_dict({**kept, **given})
