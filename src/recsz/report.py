"""What a run reports: each rank writes one record of its counters, the records of all
ranks are gathered once, and every number of a metrics row or the summary is built from
them (:func:`summarize`), so no report needs a collective of its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recsz import diskroom

if TYPE_CHECKING:
    from recsz.step import Parts


def diverged(recs: list[dict]) -> list[int]:
    """The ranks whose mean loss over the steps of a row is NaN or infinite (a row's loss is
    NaN by design only where it covers no step)."""
    return [r["rank"] for r in recs if not math.isfinite(r["loss"])]


def rank_record(parts: Parts, rank: int, loss: float, train_s: float, data_s: float) -> dict:
    """This rank's counters since the run (or the resumed run) started; JSON-like.

    ``loss``: mean loss of the steps since the last row (NaN when there were none).
    """
    ex = parts.exchange
    st = ex.stats
    st.settle()

    def tables(direction: str, which: list[int]) -> dict[int, tuple]:
        desc = ex.policies[direction].describe()
        return {
            t: (
                st.table_raw[direction][t],
                st.table_sent[direction][t],
                st.last_eb[direction].get(t),
                desc.get(t, {}).get("class"),
            )
            for t in which
        }

    dp = parts.dp
    local = parts.dense_module.local
    return {
        "rank": rank,
        "loss": loss,
        "train_s": train_s,
        "data_s": data_s,
        "a2a_fwd_s": st.a2a_s["fwd"],
        "a2a_bwd_s": st.a2a_s["bwd"],
        "codec_s": st.codec_s,
        "allreduce_s": dp.seconds,
        "allreduce_bytes": dp.bytes_sent,
        "allreduce_between": dp.bytes_between,
        # Replicated tables: held on every rank, counted once as dense tables.
        "embedding_bytes": parts.sparse.bytes_held + (local.bytes_held if local else 0),
        "embedding_bytes_dense": parts.sparse.dense_bytes
        + (local.dense_bytes if local and rank == 0 else 0),
        "fiited_kept": parts.sparse.kept(),
        "tt_cache": parts.sparse.tt.cache_hits(),
        "allreduce_dense_bytes": dp.bytes_dense,
        "raw": dict(st.raw),
        "sent": dict(st.sent),
        "wire": dict(st.wire),
        "between": dict(st.between),
        "between_raw": dict(st.between_raw),
        "max_err": dict(st.max_err),
        # Forward: the tables this rank owns; backward: every table (it sends them all).
        "tables": {"fwd": tables("fwd", ex.mine), "bwd": tables("bwd", list(st.table_raw["bwd"]))},
        # (one rank: no DDP, no hook, nothing refreshed)
        "dct_refreshes": dp.inner.refreshes if dp.mode == "dct" and dp.inner else None,
        "events": [
            {**e, "direction": d, "rank": rank}
            for d, p in ex.policies.items()
            for e in getattr(p, "events", [])
        ],
    }


def summarize(recs: list[dict], steps: int, batch_size: int) -> dict[str, Any]:
    """Speed, time split and bytes of the job from every rank's record: seconds averaged
    over ranks, bytes summed; ``steps`` of ``batch_size`` samples were timed."""
    n = len(recs)

    def mean(k: str) -> float:
        return sum(r[k] for r in recs) / n

    def total(k: str, d: str) -> int:
        return sum(r[k].get(d, 0) for r in recs)

    def ratio(raw: float, sent: float) -> float:
        return raw / sent if sent else float("nan")

    row: dict[str, Any] = {}
    losses = [r["loss"] for r in recs if r["loss"] == r["loss"]]
    if losses:
        row["loss"] = sum(losses) / len(losses)
    for k in ("a2a_fwd_s", "a2a_bwd_s", "codec_s", "allreduce_s", "train_s", "data_s"):
        row[k] = mean(k)
    busy = row["a2a_fwd_s"] + row["a2a_bwd_s"] + row["codec_s"] + row["allreduce_s"]
    row["compute_s"] = max(0.0, row["train_s"] - busy)
    row["samples_per_s"] = steps * batch_size / row["train_s"] if row["train_s"] else float("nan")
    row["bytes_raw"] = total("raw", "fwd") + total("raw", "bwd")
    row["bytes_payload"] = total("sent", "fwd") + total("sent", "bwd")
    row["bytes_sent"] = total("wire", "fwd") + total("wire", "bwd")
    row["bytes_between_hosts"] = total("between", "fwd") + total("between", "bwd")
    raw_between = total("between_raw", "fwd") + total("between_raw", "bwd")
    row["between_hosts_ratio"] = ratio(raw_between, row["bytes_between_hosts"])
    row["fwd_ratio"] = ratio(total("raw", "fwd"), total("sent", "fwd"))
    row["bwd_ratio"] = ratio(total("raw", "bwd"), total("sent", "bwd"))
    # The MLP gradients' exchange: bytes every rank put on the wire, against a ring
    # all-reduce of fp32 (dp_ratio).
    row["allreduce_bytes"] = sum(r["allreduce_bytes"] for r in recs)
    between = [r.get("allreduce_between") for r in recs]
    if any(b is not None for b in between):  # (the eb hook's: its bytes to other hosts)
        row["allreduce_bytes_between_hosts"] = sum(b or 0 for b in between)
    row["embedding_bytes"] = sum(r["embedding_bytes"] for r in recs)
    row["embedding_bytes_dense"] = sum(r["embedding_bytes_dense"] for r in recs)
    row["dp_ratio"] = ratio(sum(r["allreduce_dense_bytes"] for r in recs), row["allreduce_bytes"])
    kept = {t: f for r in recs for t, f in r.get("fiited_kept", {}).items()}
    if kept:  # FIITED: per table, the fraction of its chunks held
        row["fiited_kept"] = {str(t): round(kept[t], 4) for t in sorted(kept)}
    hits, lookups = (sum(r["tt_cache"][i] for r in recs) for i in (0, 1))
    if lookups:  # TT-Rec's caches: the share of their tables' lookups they served
        row["tt_cache_hit_rate"] = hits / lookups
    if recs[0]["dct_refreshes"] is not None:
        row["dp_threshold_refreshes"] = recs[0]["dct_refreshes"]
    row["tables"] = per_table(recs)
    return row


def per_table(recs: list[dict]) -> dict[str, dict[str, Any]]:
    """Per table: class, current bound and cumulative ratio of each direction.

    Forward numbers come from the table's owner; backward bytes are summed over all
    sample owners, and the backward class and bound are rank 0's.
    """
    out: dict[str, dict[str, Any]] = {}
    bwd: dict[str, list[int]] = {}
    for r in recs:
        for t, (raw, sent, eb, cls) in r["tables"]["fwd"].items():
            out.setdefault(str(t), {}).update(
                {"fwd_ratio": raw / sent if sent else None, "fwd_eb": eb, "fwd_class": cls}
            )
        for t, (raw, sent, eb, cls) in r["tables"]["bwd"].items():
            acc = bwd.setdefault(str(t), [0, 0])
            acc[0], acc[1] = acc[0] + raw, acc[1] + sent
            if r["rank"] == 0:
                out.setdefault(str(t), {}).update({"bwd_eb": eb, "bwd_class": cls})
    for t, (raw, sent) in bwd.items():
        out.setdefault(t, {})["bwd_ratio"] = raw / sent if sent else None
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def final_extras(recs: list[dict], check_bounds: bool) -> dict[str, Any]:
    """What only the summary carries: the policies' class changes (forward: each table's
    owner; backward: rank 0's) and, with --check-bounds, the largest error seen as a
    fraction of its bound (<= 1)."""
    out: dict[str, Any] = {
        "policy_events": [
            e for r in recs for e in r["events"] if e["direction"] == "fwd" or r["rank"] == 0
        ]
    }
    if check_bounds:
        out["max_err_over_eb"] = {
            d: max(r["max_err"].get(d, 0.0) for r in recs) for d in ("fwd", "bwd")
        }
    return out


def _steady(pace: float) -> str:
    """The pace after the first steps, where the run had steps after them."""
    return f" ({pace:.0f} after the first steps)" if math.isfinite(pace) else ""


def format_summary(s: dict[str, Any]) -> str:
    """The readable end-of-run summary."""
    return "\n".join(
        [
            "",
            "   ".join(filter(None, [f"  AUC            {s['auc']:.4f}", one_class(s)])),
            f"  logloss        {s['logloss']:.4f}",
            f"  accuracy       {s['accuracy']:.4f}",
            f"  NE             {s['ne']:.4f}   (logloss / the click rate's entropy)",
            f"  calibration    {s['calibration']:.4f}   (predicted clicks / clicks)",
            f"  evaluation     {s['eval_samples']} samples in {s['eval_s']:.2f} s",
            f"  steps          {s['steps']} on {s['world_size']} rank(s)",
            f"  samples/s      {s['samples_per_s']:.0f}{_steady(s['samples_per_s_steady'])}",
            f"  fwd ratio      {s['fwd_ratio']:.2f}x   (embedding all-to-all)",
            f"  bwd ratio      {s['bwd_ratio']:.2f}x   (gradient all-to-all)",
            f"  bytes on wire  {s['bytes_sent'] / 1e6:.2f} MB of {s['bytes_raw'] / 1e6:.2f} MB raw"
            + _between(s.get("bytes_between_hosts"), s.get("between_hosts_ratio")),
            f"  a2a time       fwd {s['a2a_fwd_s']:.2f} s, bwd {s['a2a_bwd_s']:.2f} s, "
            f"codec {s['codec_s']:.2f} s, all-reduce {s['allreduce_s']:.2f} s",
            *_trials(s.get("compress")),
            *_best(s.get("best_checkpoint"), s.get("stopped_early_at")),
        ]
    )


def _best(best: dict[str, Any] | None, early: int | None) -> list[str]:
    """Where ``--patience`` stopped the run, and the kept checkpoint evaluated best."""
    lines = [f"  stopped early  at step {early} (--patience)"] if early is not None else []
    if best:
        lines.append(f"  best kept      step {best['step']} (AUC {best['auc']:.4f}): "
                     f"{best['path']}")  # fmt: skip
    return lines


def one_class(s: dict[str, Any]) -> str:
    """Why the AUC (and the NE, or the calibration) is NaN where the held-out labels hold
    one class: a small or sorted held-out set, not a broken model."""
    if s.get("ctr") not in (0.0, 1.0):
        return ""
    which = "no click" if s["ctr"] == 0.0 else "only clicks"
    return f"(undefined: the {s['eval_samples']} held-out samples hold {which})"


def _between(n: int | None, r: float | None) -> str:
    """The bytes that crossed hosts, and their raw bytes over them, where the job spans
    several."""
    return f", {n / 1e6:.2f} MB between hosts ({r:.2f}x)" if n and r else ""


def _trials(switch: dict[str, Any] | None) -> list[str]:
    """``--compress auto``: each trial's median steps and what it chose."""
    if not switch or switch.get("mode") != "auto":
        return []
    return [
        f"  compress trial step {t['step']}: {t['compressed_s'] * 1e3:.1f} ms compressed, "
        f"{t['plain_s'] * 1e3:.1f} ms plain -> {'compressed' if t['compress'] else 'plain'}"
        for t in switch["trials"]
    ]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``. A last line cut short (the run killed while it
    wrote it) is left out; any other line that is not a JSON object is a ValueError naming
    the file and line."""
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not line.endswith("}"):  # torn: the row's write cut
                break
            raise ValueError(f"{path}, line {i}: not a JSON row ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {i}: not a JSON object")
        rows.append(row)
    return rows


def logged_aucs(out: Path) -> list[tuple[int, float]]:
    """(step, AUC) of each evaluation row in ``out``'s metrics.jsonl, in its order."""
    path = out / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    return [(int(r["step"]), float(r["eval_auc"])) for r in rows if "eval_auc" in r]


@dataclass
class Best:
    """The best held-out AUC so far, the step it was evaluated at, and the evaluations
    since that did not beat it (``--patience``); a NaN AUC beats nothing."""

    step: int | None = None
    auc: float = -math.inf
    since: int = 0

    def seen(self, step: int, auc: float) -> None:
        if auc > self.auc:
            self.step, self.auc, self.since = step, auc, 0
        else:
            self.since += 1

    @classmethod
    def of(cls, evals: list[tuple[int, float]]) -> Best:
        best = cls()
        for step, auc in evals:
            best.seen(step, auc)
        return best


def logged_eval(out: Path, step: int) -> dict[str, Any] | None:
    """The evaluation row of ``step`` in ``out``'s metrics.jsonl (its last), or None."""
    path = out / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    return next((r for r in reversed(rows) if r.get("step") == step and "eval_auc" in r), None)


class Log:
    """Writes metrics.jsonl on rank 0 only (``out`` None elsewhere), and with
    ``tensorboard`` the same rows as TensorBoard scalars in ``out/tensorboard``."""

    def __init__(
        self, out: Path | None, keep_until: int | None = None, tensorboard: bool = False
    ) -> None:
        """A new log, or (``keep_until``, a resumed run) the existing one without its rows
        after that step, which the resumed run writes again (TensorBoard hides its events
        after that step too)."""
        self.path = out / "metrics.jsonl" if out else None
        self.board: Any = None
        if not self.path:
            return
        kept = []
        if keep_until is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= keep_until]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard and out:
            from torch.utils.tensorboard import SummaryWriter

            # what an earlier attempt wrote after the rows kept (all, starting over) hidden
            purge = 0 if keep_until is None else keep_until + 1
            self.board = SummaryWriter(out / TENSORBOARD, purge_step=purge, flush_secs=10)

    def metrics(self, row: dict[str, Any]) -> None:
        if self.path:
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:  # (a write's error names no file)
                if no_room := diskroom.full(self.path, e):
                    raise no_room from e
                raise
        if self.board is not None:
            for tag, value in scalars(row).items():
                self.board.add_scalar(tag, value, row["step"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


#: Where ``--tensorboard`` writes in a run directory (``tensorboard --logdir RUN``).
TENSORBOARD = "tensorboard"


def eval_row(ev: dict[str, float]) -> dict[str, float]:
    """An evaluation's numbers as a metrics row names them (``eval_auc``, ``eval_s``)."""
    return {k if k.startswith("eval_") else f"eval_{k}": v for k, v in ev.items()}


def add_to_board(run: Path, name: str, step: int, ev: dict[str, float]) -> Path:
    """An evaluation's numbers at ``step`` (``recsz evaluate --tensorboard``), as a board
    of their own beside the run's (``RUN/tensorboard/NAME``): TensorBoard draws their
    ``eval/*`` tags on the training's charts, one line a board."""
    from torch.utils.tensorboard import SummaryWriter

    where = run / TENSORBOARD / name
    with SummaryWriter(where) as board:
        for tag, value in scalars({"step": step, **eval_row(ev)}).items():
            board.add_scalar(tag, value, step)
    return where


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's finite numbers as TensorBoard tags: ``train/loss``, ``eval/auc``,
    and a table's as ``fwd_eb/table_07`` (each number's tables side by side)."""
    out: dict[str, float] = {}
    for key, v in row.items():
        if key == "tables":
            width = max((len(t) for t in v), default=1)  # table_07 of 26: in order
            for t, numbers in v.items():
                for k, x in numbers.items():
                    out[f"{k}/table_{int(t):0{width}d}"] = x
        elif key != "step":
            out[f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"] = v
    return {
        k: float(v)
        for k, v in out.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
