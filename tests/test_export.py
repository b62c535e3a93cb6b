"""`recsz export`: a trained model written as TorchRec's DLRM gives the logits ours gives,
whatever its tables are (column shards, half precision, TT cores with their cache, FIITED's
pruned chunks, multi-hot bags), its dense inputs' count and either interaction."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recsz.model import DenseArch, ModelConfig, SparseArch
from recsz.model.fiited import FiitedSpec
from recsz.model.multihot import Bags, mlperf_draws
from recsz.model.rowopt import RowOptimizer
from recsz.model.ttrec import TTSpec

pytest.importorskip("fbgemm_gpu")
torchrec = pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")
from recsz.model.modelfile import FORMAT  # noqa: E402
from recsz.torchrec.export import exported, load_dlrm, tables_of  # noqa: E402

SIZES, DIM, BATCH = (40, 25, 60, 7), 8, 32


def _cfg(interaction: str, n_dense: int = 13) -> ModelConfig:
    return ModelConfig(SIZES, DIM, bottom_mlp=(16, DIM), top_mlp=(12, 1), n_dense=n_dense,
                       interaction=interaction, dcn_layers=2, dcn_rank=3)  # fmt: skip


def _batch(step: int, n_dense: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.stack([torch.randint(0, n, (BATCH,), generator=g) for n in SIZES], 1)
    dense = torch.rand(BATCH, n_dense, generator=g)
    return dense, ids, torch.randint(0, 2, (BATCH,), generator=g)


def _kjt(ids: torch.Tensor, hot: tuple[int, ...] | None, draws: str = "hash") -> object:
    """The samples' ids as TorchRec's DLRM takes them: feature cat_t, one id a bag, or each
    id's bag as recsz makes it (``draws``: "mlperf", as MLPerf's reference does)."""
    hot = hot or (1,) * len(SIZES)
    drawn = mlperf_draws(SIZES, hot, range(len(SIZES))) if draws == "mlperf" else None
    bags = Bags(range(len(SIZES)), hot, SIZES, [0] * len(SIZES), drawn).ids(ids)
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=[f"cat_{t}" for t in range(len(SIZES))],
        values=torch.cat([b.reshape(-1) for b in bags.split(hot, 1)]),
        lengths=torch.tensor(hot).repeat_interleave(BATCH),
    )


CASES = {
    "dot": {},
    "dcn": {"interaction": "dcn"},
    "5 dense inputs (--dense-features)": {"n_dense": 5},
    "5 dense inputs, dcn": {"n_dense": 5, "interaction": "dcn"},
    "column shards": {"shards": 2},
    "fp16 tables": {"dtype": torch.float16},
    "multi-hot": {"hotness": (3, 1, 2, 4)},
    "multi-hot, MLPerf's draws": {"hotness": (3, 1, 2, 4), "bag_draws": "mlperf"},
    "tt, cached": {"tt": TTSpec(frozenset({0, 2}), 4, 3, cache_rows=5, cache_interval=2)},
    "tt, replicated": {"tt": TTSpec(frozenset({1}), 4, 3, placement="replicated")},
    "fiited": {"fiited": FiitedSpec(0.5, 4, interval=1)},
}


@pytest.mark.parametrize("case", CASES)
def test_the_exported_model_gives_our_logits(case: str, tmp_path: Path) -> None:
    """Trained a few steps (rows, caches and pruning all moved), written by `exported`
    through a file and loaded by `load_dlrm`: TorchRec's model gives our logits."""
    kw = dict(CASES[case])
    n_dense = kw.pop("n_dense", 13)
    cfg = _cfg(kw.pop("interaction", "dot"), n_dense)
    shards = kw.get("shards", 1)
    tt = kw.get("tt")
    local_set = tt.replicated if tt is not None else frozenset()
    held = [t for t in range(len(SIZES) * shards) if t not in local_set]
    opt = RowOptimizer("adagrad", 0.1)
    sparse = SparseArch(cfg, held, 0, opt, **kw)
    local = None
    if local_set:
        from recsz.model.ttrec import TTTables

        local = TTTables(cfg, sorted(local_set), 0, opt, tt)
    dense = DenseArch(cfg, 0, local=local)

    def pooled(ids: torch.Tensor) -> torch.Tensor:  # the replicated tables' columns zero
        got = sparse(ids)
        out = got.new_zeros(BATCH, len(SIZES) * shards, got.shape[2])
        return out.index_copy(1, torch.tensor(held), got)

    params = [*dense.parameters()]
    dense_opt = torch.optim.SGD(params, lr=0.1)
    loss = torch.nn.BCEWithLogitsLoss()
    for step in range(6):
        x, ids, y = _batch(step, n_dense)
        logits = dense(x, pooled(ids), ids)
        dense_opt.zero_grad()
        loss(logits, y.float()).backward()
        dense_opt.step()
        if local is not None:
            local.step()
        sparse.prune()
    parts = SimpleNamespace(sparse=sparse, dense_module=dense)
    draws = kw.get("bag_draws", "hash")
    blob = exported(
        cfg, tables_of(parts, len(SIZES)), dense.torchrec_mlps(), kw.get("hotness"), draws
    )  # type: ignore[arg-type]
    assert blob["bag_draws"] == (draws if "hotness" in kw else None)
    torch.save(blob, tmp_path / "m.pt")
    theirs = load_dlrm(tmp_path / "m.pt")
    assert type(theirs).__name__ == ("DLRM_DCN" if cfg.interaction == "dcn" else "DLRM")
    x, ids, _ = _batch(100, n_dense)
    with torch.no_grad():
        ours = dense(x, pooled(ids), ids)
        got = theirs(x, _kjt(ids, kw.get("hotness"), draws)).view(-1)
    torch.testing.assert_close(got, ours, rtol=1e-5, atol=1e-5)
    if case == "fiited":  # pruned chunks went out as zeros
        assert any(bool((w == 0).any()) for w in tables_of(parts, len(SIZES)))  # type: ignore[arg-type]


def test_mlps_out_and_back_in_are_the_same() -> None:
    """torchrec_mlps is load_torchrec_mlps' inverse (the dot interaction's pairs
    reordered there and back)."""
    cfg = _cfg("dot")
    a, b = DenseArch(cfg, 0), DenseArch(cfg, 1)
    b.load_torchrec_mlps(a.torchrec_mlps())
    for p, q in zip(a.mlp_parameters(), b.mlp_parameters(), strict=True):
        assert torch.equal(p, q)
    first_top = len(list(a.bottom.parameters()))
    assert not torch.equal(a.torchrec_mlps()[first_top], a.mlp_parameters()[first_top])


def test_files_that_are_not_exports_are_named(tmp_path: Path) -> None:
    """Another torch file, a table of another shape, a parameter of another shape, a
    parameter short, a file cut short: each named with the file."""
    other = tmp_path / "other.pt"
    torch.save({"weight": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match=f"other.pt: not a recsz model file \\({FORMAT}\\)"):
        load_dlrm(other)
    cfg = _cfg("dot")
    dense = DenseArch(cfg, 0)
    tables = [torch.zeros(n, DIM) for n in SIZES]
    with pytest.raises(ValueError, match="MLP parameters"):
        exported(cfg, tables, dense.torchrec_mlps()[:-1])
    blob = exported(cfg, tables, dense.torchrec_mlps())
    key = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_1.weight"
    bad = {**blob, "state_dict": {**blob["state_dict"], key: torch.zeros(3, DIM)}}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"bad\.pt: table 1 is \(3, 8\), its shape says \(25, 8\)"):
        load_dlrm(tmp_path / "bad.pt")
    first = "dense_arch.model._mlp.0._linear.weight"
    bad = {**blob, "state_dict": {**blob["state_dict"], first: torch.zeros(2, 2)}}
    torch.save(bad, tmp_path / "mlp.pt")
    with pytest.raises(ValueError, match=r"mlp\.pt: its weights do not fit its model"):
        load_dlrm(tmp_path / "mlp.pt")
    last = "over_arch.model.1.bias"
    short = {**blob, "state_dict": {k: v for k, v in blob["state_dict"].items() if k != last}}
    torch.save(short, tmp_path / "short.pt")
    with pytest.raises(ValueError, match=r"short\.pt: 7 MLP parameters, its DLRM has 8"):
        load_dlrm(tmp_path / "short.pt")
    torch.save(blob, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:1000])
    (tmp_path / "text.pt").write_text("not a model\n")
    for name in ("cut", "text"):
        with pytest.raises(ValueError, match=rf"{name}\.pt: not a model file torch can read"):
            load_dlrm(tmp_path / f"{name}.pt")


@pytest.mark.parametrize(("shards", "dtype"), [(1, torch.float32), (2, torch.float16)])
def test_tables_start_from_a_files_whole_tables(
    shards: int, dtype: torch.dtype, tmp_path: Path
) -> None:
    """--init-from: a rank's tables (some of the model's, in column shards, half rows)
    take their rows from the file's whole tables (rounded to their dtype); the MLPs
    theirs; the model then gives the file's model's logits."""
    from recsz.model.modelfile import read

    cfg = _cfg("dot")
    src_sparse = SparseArch(cfg, range(len(SIZES)), 3, RowOptimizer("sgd", 0.1))
    src_dense = DenseArch(cfg, 3)
    parts = SimpleNamespace(sparse=src_sparse, dense_module=src_dense)
    blob = exported(cfg, tables_of(parts, len(SIZES)), src_dense.torchrec_mlps())  # type: ignore[arg-type]
    torch.save(blob, tmp_path / "m.pt")
    f = read(tmp_path / "m.pt")
    f.check(cfg)
    held = [t * shards + c for t in (1, 3) for c in range(shards)]  # tables 1 and 3
    sparse = SparseArch(cfg, held, 0, RowOptimizer("sgd", 0.1), dtype=dtype, shards=shards)
    sparse.start_from(f.tables)
    dense = DenseArch(cfg, 0)
    dense.load_torchrec_mlps(f.mlps)
    _, ids, _ = _batch(7)
    got = sparse(ids).reshape(BATCH, 2, DIM)
    want = src_sparse(ids)[:, [1, 3]]
    tol = 1e-3 if dtype == torch.float16 else 0.0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    x = _batch(7)[0]
    with torch.no_grad():
        whole = SparseArch(cfg, range(len(SIZES)), 0, RowOptimizer("sgd", 0.1))
        whole.start_from(f.tables)
        torch.testing.assert_close(dense(x, whole(ids)), src_dense(x, src_sparse(ids)))


def test_init_from_is_refused_where_it_cannot_start_the_run(tmp_path: Path) -> None:
    """Before any rank starts: a file of another model (what differs named), a file that
    is not there, a directory (a run's: the export named), TT or FIITED tables."""
    from recsz.config import parse_train_args
    from recsz.model import get_preset

    cfg = get_preset("tiny").model
    dense = DenseArch(cfg, 0)
    tables = [torch.zeros(n, cfg.emb_dim) for n in cfg.table_sizes]
    torch.save(exported(cfg, tables, dense.torchrec_mlps()), tmp_path / "tiny.pt")
    parse_train_args(["--preset", "tiny", "--init-from", str(tmp_path / "tiny.pt")])
    with pytest.raises(ValueError, match=r"tiny\.pt: its table_sizes are"):
        parse_train_args(["--preset", "kaggle", "--init-from", str(tmp_path / "tiny.pt")])
    dcn = ["--preset", "tiny", "--interaction", "dcn", "--init-from", str(tmp_path / "tiny.pt")]
    with pytest.raises(ValueError, match=r"a DLRM model, this run's is a DLRM_DCN"):
        parse_train_args(dcn)
    with pytest.raises(FileNotFoundError, match=r"gone\.pt: no such model file"):
        parse_train_args(["--preset", "tiny", "--init-from", str(tmp_path / "gone.pt")])
    with pytest.raises(FileNotFoundError, match=r"a directory, not a model file .*recsz export"):
        parse_train_args(["--preset", "tiny", "--init-from", str(tmp_path)])  # a run's, say
    for flags in (["--tt-tables", "2"], ["--fiited-budget", "0.5"]):
        with pytest.raises(ValueError, match="--init-from with --fiited-budget or --tt-tables"):
            parse_train_args(["--preset", "tiny", "--init-from", str(tmp_path / "tiny.pt"), *flags])


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_a_torchrec_dlrm_saved_starts_our_model(interaction: str, tmp_path: Path) -> None:
    """save_dlrm: TorchRec's own DLRM (or DLRM_DCN, inside a module as DLRMTrain holds it)
    written as a model file: loaded back it is the same model, and our model started from
    it (what --init-from does) gives its logits."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    from recsz.model.modelfile import read
    from recsz.torchrec import save_dlrm

    cfg = _cfg(interaction)
    torch.manual_seed(4)
    configs = [
        torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=n,
                                    feature_names=[f"cat_{t}"])
        for t, n in enumerate(SIZES)
    ]  # fmt: skip
    ebc = torchrec.EmbeddingBagCollection(tables=configs)
    shape = (ebc, 13, list(cfg.bottom_mlp), list(cfg.top_mlp))
    theirs = DLRM(*shape) if interaction == "dot" else DLRM_DCN(*shape, 2, 3)
    holder = torch.nn.Module()
    holder.model = theirs
    save_dlrm(holder, tmp_path / "t.pt")
    x, ids, _ = _batch(3)
    with torch.no_grad():
        want = theirs(x, _kjt(ids, None)).view(-1)
        again = load_dlrm(tmp_path / "t.pt")(x, _kjt(ids, None)).view(-1)
    assert torch.equal(again, want)
    f = read(tmp_path / "t.pt")
    f.check(cfg)
    sparse = SparseArch(cfg, range(len(SIZES)), 0, RowOptimizer("sgd", 0.1))
    sparse.start_from(f.tables)
    dense = DenseArch(cfg, 0)
    dense.load_torchrec_mlps(f.mlps)
    with torch.no_grad():
        torch.testing.assert_close(dense(x, sparse(ids)), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not TorchRec's DLRM"):
        save_dlrm(torch.nn.Linear(2, 2), tmp_path / "x.pt")


def test_a_run_of_its_own_shape_exports_warm_starts_and_resumes_as_itself(
    tmp_path: Path,
) -> None:
    """--emb-dim, --bottom-mlp, --top-mlp and --max-rows make the model (the preset's
    otherwise): its export holds that shape, a warm start of it trains, one of the preset's
    shape is refused (what differs named), and a resume with another shape is another
    run's (the field named)."""
    from recsz.cli import main as cli_main
    from recsz.model import modelfile
    from recsz.train import main as train_main

    base = ["--steps", "4", "--batch-size", "32", "--synthetic-eval", "256", "--no-progress",
            "--checkpoint-every", "4"]  # fmt: skip
    shape = ["--emb-dim", "8", "--bottom-mlp", "24-8", "--top-mlp", "12-1", "--max-rows", "300"]
    out, file = tmp_path / "run", tmp_path / "m.pt"
    assert train_main([*base, *shape, "--out", str(out)]) == 0
    assert cli_main(["export", str(out), "--out", str(file)]) == 0
    got = modelfile.read(file)
    assert got.shape["dense_arch_layer_sizes"] == [24, 8]
    assert got.shape["over_arch_layer_sizes"] == [12, 1]
    assert {t.shape[1] for t in got.tables} == {8} and max(t.shape[0] for t in got.tables) == 300
    assert train_main([*base, *shape, "--init-from", str(file), "--out", str(tmp_path / "w")]) == 0
    with pytest.raises(ValueError, match=r"m\.pt: its table_sizes are"):
        train_main([*base, "--init-from", str(file), "--out", str(tmp_path / "preset")])
    with pytest.raises(ValueError, match=r"max_rows: 300 -> 200"):
        train_main(["--resume", str(out), "--steps", "6", "--max-rows", "200", "--no-progress"])
