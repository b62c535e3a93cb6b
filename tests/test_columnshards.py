"""Column shards (``--column-shards K``): each table's columns split into K tables of
dim/K. Against the unsplit tables, the plain reference: the same start, the same lookups
side by side (bags too), the same updates (SGD and exact Adagrad; row-wise Adagrad keeps
one accumulator a shard's row, as TorchRec's column-wise shards do), and one process
trains to the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.config import parse_train_args
from recsz.model import ModelConfig, RowOptimizer, SparseArch
from recsz.model.sharding import column_shards, plan_tables
from recsz.train import main

CFG = ModelConfig(table_sizes=(30, 7, 50), emb_dim=8, bottom_mlp=(8,), top_mlp=(1,))


def joined(shards: SparseArch, k: int) -> torch.Tensor:
    """The shards' rows as the unsplit tables' (rows of every table, D columns)."""
    out = []
    for t, n in enumerate(CFG.table_sizes):
        cols = []
        for c in range(k):
            j = shards.dense_tables.index(t * k + c)
            start = int(shards.offsets[j])
            cols.append(shards.weight.detach()[start : start + n].float())
        out.append(torch.cat(cols, 1))
    return torch.cat(out)


def test_the_shards_are_the_tables_columns_and_plan_as_tables() -> None:
    sizes, width = column_shards(CFG.table_sizes, CFG.emb_dim, 4)
    assert sizes == [30] * 4 + [7] * 4 + [50] * 4 and width == 2
    with pytest.raises(ValueError, match="--column-shards 3: must divide the tables' dim 8"):
        column_shards(CFG.table_sizes, CFG.emb_dim, 3)
    owners = plan_tables([40_000_000] * 4 + [10] * 4, 32, 4)  # one big table's 4 shards
    assert sorted(owners[:4]) == [0, 1, 2, 3]  # spread over the ranks, not on one


@settings(max_examples=25, deadline=None)
@given(
    k=st.sampled_from([2, 4, 8]),
    kind=st.sampled_from(["sgd", "adagrad"]),
    hot=st.sampled_from([None, (3, 1, 2)]),
    seed=st.integers(0, 1000),
)
def test_shards_look_up_and_learn_as_their_tables(k: int, kind: str, hot, seed: int) -> None:
    """Random ids (repeats within a batch), one-hot or bags: the pooled vectors of the K
    shards side by side are the table's, and after two updates (SGD or exact Adagrad) the
    shards hold the table's columns."""
    g = torch.Generator().manual_seed(seed)
    whole = SparseArch(CFG, range(3), 5, RowOptimizer(kind, 0.3), hotness=hot)
    split = SparseArch(CFG, range(3 * k), 5, RowOptimizer(kind, 0.3), hotness=hot, shards=k)
    assert torch.equal(joined(split, k), whole.weight.detach())
    for _ in range(2):
        ids = torch.stack([torch.randint(0, n, (16,), generator=g) for n in CFG.table_sizes], 1)
        a, b = whole(ids), split(ids)
        torch.testing.assert_close(b.reshape(16, 3, CFG.emb_dim), a, rtol=0, atol=0)
        grad = torch.randn(a.shape, generator=g)
        a.backward(grad)
        b.backward(grad.reshape(b.shape))
        torch.testing.assert_close(joined(split, k), whole.weight.detach(), rtol=1e-6, atol=1e-7)


def test_rowwise_adagrad_keeps_an_accumulator_a_shards_row() -> None:
    """Row-wise Adagrad's one accumulator a row becomes one a shard's row (the mean square
    of its D/K columns' gradients): K accumulators a row, each its shard's."""
    split = SparseArch(CFG, range(6), 5, RowOptimizer("rowwise_adagrad", 0.1), shards=2)
    ids = torch.tensor([[3, 1, 9]])
    out = split(ids)
    grad = torch.zeros(out.shape)
    grad[0, 0, :] = torch.tensor([1.0, 1.0, 1.0, 1.0])  # shard 0 of table 0
    grad[0, 1, :] = torch.tensor([2.0, 2.0, 2.0, 2.0])  # shard 1 of table 0
    out.backward(grad)
    acc = split.optimizer_state
    assert float(acc[int(split.offsets[0]) + 3]) == pytest.approx(1.0)
    assert float(acc[int(split.offsets[1]) + 3]) == pytest.approx(4.0)


def _run(tmp: Path, *flags: str) -> tuple[list[float], dict]:
    out = tmp / "-".join(flags).replace("--", "")
    argv = ["--steps", "12", "--batch-size", "64", "--synthetic-eval", "512", "--no-progress",
            "--log-every", "4", "--emb-optimizer", "sgd", "--out", str(out), *flags]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], json.loads((out / "summary.json").read_text())


def test_one_process_trains_as_with_whole_tables(tmp_path: Path) -> None:
    """`recsz train --column-shards 4` (SGD, codec none; bags too): the same losses and
    held-out numbers as the whole tables, its exchange counting 4x the tables."""
    for extra in ((), ("--multi-hot", "3")):
        want, s1 = _run(tmp_path, *extra)
        got, s4 = _run(tmp_path, "--column-shards", "4", *extra)
        assert got == pytest.approx(want, rel=1e-6)
        assert s4["auc"] == pytest.approx(s1["auc"], abs=1e-6)
        assert len(s4["per_table"]) == 4 * len(s1["per_table"])
        named = {k: (s4["per_table"][k]["table"], s4["per_table"][k]["shard"]) for k in "567"}
        assert named == {"5": (1, 1), "6": (1, 2), "7": (1, 3)}  # shard c of table t: 4t + c


def test_what_column_shards_cannot_take_is_refused() -> None:
    for flags, message in (
        (["--column-shards", "3"], "must divide the tables' dim 16"),
        (["--column-shards", "2", "--tt-tables", "1"], "--column-shards with --fiited-budget"),
        (["--column-shards", "2", "--fiited-budget", "0.5"], "--column-shards with --fiited"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_train_args(flags)
    with pytest.raises(ValueError, match="column shards of TT or FIITED tables"):
        from recsz.model.ttrec import TTSpec

        SparseArch(CFG, range(6), 0, tt=TTSpec(frozenset({0}), 4, 3), shards=2)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize(("k_old", "k_new"), [(1, 4), (4, 1), (2, 4), (4, 2), (2, 2)])
def test_a_tables_state_changes_its_column_shards(kind: str, k_old: int, k_new: int) -> None:
    """Tables trained in ``k_old`` shards, their saved pieces recut into ``k_new``
    (``--column-shards`` changed on resume) and loaded: the rows are the same columns, the
    per-element state too; row-wise Adagrad's one a shard's row is the mean of the old
    shards' (exactly the whole row's where they merge), each new shard starting from it."""
    from recsz.model import tablestate

    g = torch.Generator().manual_seed(k_old * 10 + k_new)
    sizes = list(CFG.table_sizes)
    old = SparseArch(CFG, range(3 * k_old), 5, RowOptimizer(kind, 0.3), shards=k_old)
    for _ in range(2):
        ids = torch.stack([torch.randint(0, n, (16,), generator=g) for n in sizes], 1)
        out = old(ids)
        out.backward(torch.randn(out.shape, generator=g))
    old_sizes = column_shards(sizes, CFG.emb_dim, k_old)[0]
    pieces = tablestate.split(old.state_dict(), old.tables, old_sizes, ())
    pieces = tablestate.recolumned(pieces, 3, k_old, k_new)
    new = SparseArch(CFG, range(3 * k_new), 0, RowOptimizer(kind, 0.3), shards=k_new)
    new.load_state_dict(tablestate.join(pieces, new.tables, (), new.state_dict()))
    assert torch.equal(joined(new, k_new), joined(old, k_old))
    b = new.optimizer_state
    if kind == "adagrad":  # per element: the same columns
        assert torch.equal(joined_state(new, k_new), joined_state(old, k_old))
    elif kind == "rowwise_adagrad":  # per row: the old shards' mean, in every new shard
        want = _row_means(old, k_old)
        for t in range(3):
            for c in range(k_new):
                j = t * k_new + c
                start = int(new.offsets[j])
                got = b[start : start + sizes[t]]
                torch.testing.assert_close(got, want[t], rtol=1e-6, atol=0)
    else:
        assert not b.numel()


def joined_state(shards: SparseArch, k: int) -> torch.Tensor:
    """Exact Adagrad's per-element state as the unsplit tables' (like :func:`joined`)."""
    out = []
    for t, n in enumerate(CFG.table_sizes):
        starts = [int(shards.offsets[shards.dense_tables.index(t * k + c)]) for c in range(k)]
        out.append(torch.cat([shards.optimizer_state[s : s + n] for s in starts], 1))
    return torch.cat(out)


def _row_means(shards: SparseArch, k: int) -> list[torch.Tensor]:
    """Row-wise Adagrad's accumulators of each table: the mean over its k shards'."""
    out = []
    for t, n in enumerate(CFG.table_sizes):
        starts = [int(shards.offsets[shards.dense_tables.index(t * k + c)]) for c in range(k)]
        out.append(torch.stack([shards.optimizer_state[s : s + n] for s in starts]).mean(0))
    return out


def test_the_exchanges_counters_follow_the_tables_into_new_shards() -> None:
    """Per-table bytes of 2 shards a table recut into 3: each table's totals kept, shared
    out to its new shards; the run's totals unchanged."""
    from recsz.comm.stats import CommStats

    s = CommStats()
    for v, n in enumerate([10, 20, 7, 8]):  # tables 0 and 1, 2 shards each
        s.table_raw["fwd"][v] += n
        s.table_sent["fwd"][v] += n // 2
    s.raw["fwd"] = 45
    s.last_eb["fwd"].update({0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4})
    r = s.recolumned(2, 3)
    assert r.raw["fwd"] == 45
    assert [sum(r.table_raw["fwd"][3 * t + c] for c in range(3)) for t in (0, 1)] == [30, 15]
    assert [sum(r.table_sent["fwd"][3 * t + c] for c in range(3)) for t in (0, 1)] == [15, 7]
    assert r.last_eb["fwd"] == {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.3, 4: 0.3, 5: 0.3}


def test_recsz_plan_says_what_each_rank_would_hold(tmp_path: Path, capsys) -> None:
    """`recsz plan`: the ranks' loads sum to the model's tables (rows, bytes at the dtype,
    the row optimizer's state), their send shares to 1; the same plan as a run's; a run's
    own shape (--max-rows, --emb-dim); a flag no plan takes is refused, a bad one named."""
    from recsz.cli import main as cli
    from recsz.model import get_preset

    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "dcnv2", "--nproc", "64", "--column-shards", "4",
            "--table-dtype", "fp16", "--json", str(out)]  # fmt: skip
    assert cli(argv) == 0
    assert "0 rank(s) hold no table" in capsys.readouterr().out
    ranks = json.loads(out.read_text())["ranks"]
    m = get_preset("dcnv2").model
    rows = sum(m.table_sizes) * 4  # each table's rows, once a shard
    assert sum(r["rows"] for r in ranks) == rows
    assert sum(r["table_bytes"] for r in ranks) == rows * 32 * 2  # dim 128 / 4, fp16
    assert sum(r["optimizer_bytes"] for r in ranks) == rows * 4  # row-wise Adagrad (preset's)
    assert sum(r["send_share"] for r in ranks) == pytest.approx(1.0)
    sizes, dim = column_shards(m.table_sizes, m.emb_dim, 4)
    owners = plan_tables(sizes, dim, 64)
    assert [r["tables"] for r in ranks] == [owners.count(r) for r in range(64)]
    assert all(r["held_bytes"] == r["table_bytes"] + r["optimizer_bytes"] for r in ranks)
    # the run's own shape: its tables' rows capped, their dim
    argv = ["plan", "--preset", "dcnv2", "--nproc", "8", "--max-rows", "1000000",
            "--emb-dim", "64", "--json", str(out)]  # fmt: skip
    assert cli(argv) == 0
    ranks = json.loads(out.read_text())["ranks"]
    rows = sum(min(n, 1_000_000) for n in m.table_sizes)
    assert sum(r["rows"] for r in ranks) == rows
    assert sum(r["table_bytes"] for r in ranks) == rows * 64 * 4
    with pytest.raises(SystemExit, match="2"):
        cli(["plan", "--lr", "0.1"])  # not a flag of the plan: argparse's usage error
    assert cli(["plan", "--column-shards", "3"]) == 2  # named: does not divide dim 16
    assert cli(["plan", "--nproc", "0"]) == 2
    assert "--nproc must be >= 1, got 0" in capsys.readouterr().err  # (not the batch it makes)


def test_recsz_plan_plans_a_runs_or_a_files_options(tmp_path: Path, capsys) -> None:
    """`recsz plan --config`: the options of a run's directory or a TOML file (with those
    the plan has no flag for: TT tables charged their cores), flags given over them, the
    same plan as :func:`recsz.step.table_owners` of that configuration; a file's bad key
    named with the file; its output cut short (`| head`): quiet."""
    from recsz.cli import main as cli
    from recsz.config import TrainConfig
    from recsz.step import table_owners

    toml = tmp_path / "run.toml"
    toml.write_text('preset = "bench"\ntt_tables = 3\nnproc = 8\nbatch_size = 2048\n')
    out = tmp_path / "plan.json"
    assert cli(["plan", "--config", str(toml), "--json", str(out)]) == 0
    ranks = json.loads(out.read_text())["ranks"]
    cfg = TrainConfig(preset="bench", tt_tables=3, nproc=8, batch_size=2048)
    owners = table_owners(cfg, 8)
    assert len(ranks) == 8 and [r["tables"] for r in ranks] == [owners.count(r) for r in range(8)]
    plain = TrainConfig(preset="bench", nproc=8, batch_size=2048)
    assert owners != table_owners(plain, 8)  # (the TT tables count)
    assert cli(["plan", "--config", str(toml), "--nproc", "2", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["ranks"]) == 2  # the flag over the file
    run = tmp_path / "run"
    (run / "x").mkdir(parents=True)
    (run / "config.json").write_text(TrainConfig(preset="dcnv2", nproc=4).to_json())
    capsys.readouterr()
    assert cli(["plan", "--config", str(run)]) == 0
    assert capsys.readouterr().out.startswith("recsz plan: preset dcnv2, 4 rank(s)")
    toml.write_text('presett = "bench"\n')
    assert cli(["plan", "--config", str(toml)]) == 2
    assert f"{toml}: 'presett' is not an option (did you mean 'preset'?)" in capsys.readouterr().err
    import subprocess
    import sys

    done = subprocess.run(f"{sys.executable} -m recsz.cli plan --nproc 64 | head -1",
                          shell=True, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout.startswith("recsz plan:") and done.stderr == "", done.stderr


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize(("k_old", "k_new"), [(3, 4), (4, 3), (2, 6), (6, 1)])
def test_a_rank_recuts_only_the_shards_it_holds(kind: str, k_old: int, k_new: int) -> None:
    """recolumned(wanted=...): the pieces of the new shards a rank holds (where new shards
    straddle old ones: dim 12, 3 <-> 4 shards), each the whole table's columns cut anew,
    and no other table's; the same as recutting every table."""
    from recsz.model import tablestate

    cfg = ModelConfig(table_sizes=(30, 7, 50), emb_dim=12, bottom_mlp=(12,), top_mlp=(1,))
    g = torch.Generator().manual_seed(k_old + 10 * k_new)
    old = SparseArch(cfg, range(3 * k_old), 5, RowOptimizer(kind, 0.3), shards=k_old)
    ids = torch.stack([torch.randint(0, n, (16,), generator=g) for n in cfg.table_sizes], 1)
    out = old(ids)
    out.backward(torch.randn(out.shape, generator=g))
    sizes = column_shards(list(cfg.table_sizes), 12, k_old)[0]
    pieces = tablestate.split(old.state_dict(), old.tables, sizes, ())
    wanted = {0, 3 * k_new - 1, k_new}  # table 0's first, table 2's last, table 1's first
    some = tablestate.recolumned(pieces, 3, k_old, k_new, wanted)
    every = tablestate.recolumned(pieces, 3, k_old, k_new)
    assert set(some) == wanted and len(every) == 3 * k_new
    whole = old.table_weights()
    width = 12 // k_new
    for j in wanted:
        t, c = divmod(j, k_new)
        want = torch.cat([whole[t * k_old + i] for i in range(k_old)], 1)
        assert torch.equal(some[j]["weight"], want[:, c * width : (c + 1) * width])
        assert torch.equal(some[j]["weight"], every[j]["weight"])
        assert torch.equal(some[j]["optimizer_state"], every[j]["optimizer_state"])
        if kind == "adagrad":  # per element: the whole table's state, cut anew
            state = torch.cat([pieces[t * k_old + i]["optimizer_state"] for i in range(k_old)], 1)
            cols = slice(c * width, (c + 1) * width)
            assert torch.equal(some[j]["optimizer_state"], state[:, cols])


def test_the_plan_counts_mlperfs_draws_on_each_rank_of_a_tables_shards(tmp_path, capsys) -> None:
    """`recsz plan --multi-hot mlperf --multi-hot-draws mlperf`: a table's draws (rows x
    (bag - 1) int32) on every rank holding a shard of it, in what the rank holds; none with
    the hashed bags."""
    from recsz.cli import main as cli
    from recsz.config import TrainConfig
    from recsz.model import get_preset
    from recsz.model.multihot import MLPERF_HOTNESS
    from recsz.step import table_owners

    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "dcnv2", "--nproc", "8", "--column-shards", "2",
            "--multi-hot", "mlperf", "--json", str(out)]  # fmt: skip
    assert cli(argv) == 0
    assert all(r["draws_bytes"] == 0 for r in json.loads(out.read_text())["ranks"])
    assert cli([*argv, "--multi-hot-draws", "mlperf"]) == 0
    ranks = json.loads(out.read_text())["ranks"]
    m = get_preset("dcnv2").model
    cfg = TrainConfig(preset="dcnv2", column_shards=2, multi_hot="mlperf",
                      multi_hot_draws="mlperf", batch_size=8)  # fmt: skip
    owners = table_owners(cfg, 8)  # the run's plan: each shard charged its table's draws
    assert owners != plan_tables(*column_shards(m.table_sizes, m.emb_dim, 2), 8)
    for r, load in enumerate(ranks):
        mine = {t // 2 for t, o in enumerate(owners) if o == r}
        want = sum(4 * m.table_sizes[t] * (MLPERF_HOTNESS[t] - 1) for t in mine)
        assert load["draws_bytes"] == want
    assert max(r["draws_bytes"] for r in ranks) >= 4 * 40_000_000 * 99  # feature 20 and more
    for load in ranks:  # the columns add up to what a run holds the rank to (step.held_bytes)
        parts = load["table_bytes"] + load["optimizer_bytes"] + load["draws_bytes"]
        assert load["held_bytes"] == parts
    assert "bags' draws GB" in capsys.readouterr().out
