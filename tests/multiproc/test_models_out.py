"""A distributed run's model put to use: tables in column shards on 2 ranks as one
process's, exported as TorchRec's DLRM, warm-starting another run, evaluated and
scoring unlabeled lines on any number of ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from recsz.train import main
from tests.multiproc.runs import (
    BASE,
    SIZES,
    dense,
    losses,
    run,
    tables,
)

pytestmark = pytest.mark.slow


SHARDED = ("--fwd-codec", "zstd", "--bwd-codec", "zstd", "--column-shards", "2")


@pytest.fixture(scope="module")
def two_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks, every table in 2 column shards, a lossless codec."""
    out = tmp_path_factory.mktemp("two-sharded")
    s = run(out, *SHARDED, nproc=2)
    assert len(s["per_table"]) == 52 and "tables" not in s  # the per-table rows once
    return out


def test_column_shards_on_two_ranks_match_one_process(
    single: Path, two_sharded: Path, tmp_path: Path
) -> None:
    """--column-shards 2 (zstd: lossless): 2 ranks end where one process of whole tables
    does (losses, MLPs, every table's columns, its shards joined); a checkpoint of the 2
    ranks resumed on one process ends there too, and so does one of whole tables on 2
    ranks resumed on one process in 4 shards a table."""
    flags, two, moved = (
        SHARDED,
        two_sharded,
        tmp_path / "moved",
    )  # (one process: test_columnshards.py)
    torch.testing.assert_close(
        torch.tensor(losses(two)), torch.tensor(losses(single)), rtol=0, atol=1e-5
    )
    run(moved, *flags, "--steps", "10", "--checkpoint-every", "10", nproc=2)
    run(moved, *flags, "--resume", str(moved))
    # whole tables on 2 ranks, resumed on one in 4 shards a table: recut, the same run
    regrown = tmp_path / "regrown"
    run(regrown, *flags[:4], "--steps", "10", "--checkpoint-every", "10", nproc=2)
    run(regrown, *flags[:4], "--resume", str(regrown), "--column-shards", "4")
    for d in (moved, regrown):
        torch.testing.assert_close(
            torch.tensor(losses(d)), torch.tensor(losses(single)), rtol=0, atol=1e-5
        )
    for d in (two, moved):
        shards = tables(d, shards=2)
        whole = tables(single)
        assert sorted(shards) == list(range(52))
        for t in range(26):
            joined = torch.cat([shards[2 * t], shards[2 * t + 1]], 1)
            torch.testing.assert_close(joined, whole[t], rtol=0, atol=1e-5, msg=f"table {t}")
        da, db = dense(single), dense(d)
        for k in da:
            torch.testing.assert_close(db[k], da[k], rtol=0, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def exported_model(two_sharded: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`recsz export` of :func:`two_sharded`'s run."""
    pytest.importorskip("torchrec")
    from recsz.cli import main as cli

    out = tmp_path_factory.mktemp("export") / "model.pt"
    assert cli(["export", str(two_sharded), "--out", str(out)]) == 0
    return out


def restored_logits(run_dir: Path, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The logits of a run's model (its newest checkpoint, restored on this process)."""
    from argparse import Namespace

    from recsz.evaluation import restored

    with restored(Namespace(run=str(run_dir), device="cpu"), ("device",)) as r, torch.no_grad():
        return r.parts.dense_module(dense, r.parts.sparse(ids))


def test_export_writes_the_runs_model_as_torchrecs_dlrm(
    two_sharded: Path, exported_model: Path, tmp_path: Path
) -> None:
    """`recsz export RUN --out F`: 2 ranks' checkpoint of tables in column shards, joined
    on one process into TorchRec's DLRM, whose logits are those of the run's model
    restored here; a directory that is not there is refused before any work."""
    from recsz.cli import main as cli
    from recsz.data.source import make_source
    from recsz.torchrec import load_dlrm

    assert cli(["export", str(two_sharded), "--out", str(tmp_path / "no" / "m.pt")]) == 2
    theirs = load_dlrm(exported_model)
    b = make_source("synthetic", SIZES, 9).train_batch(0, 256)
    ids, x = torch.as_tensor(b.ids), torch.as_tensor(b.dense)
    ours = restored_logits(two_sharded, x, ids)
    with torch.no_grad():
        got = theirs(x, torchrec_kjt(ids)).view(-1)
    torch.testing.assert_close(got, ours, rtol=1e-5, atol=1e-5)


def test_init_from_starts_a_new_run_from_an_exported_model(
    two_sharded: Path, exported_model: Path, tmp_path: Path
) -> None:
    """`--init-from F` (a warm start): a run on other data (seed), another rate and whole
    tables on 2 ranks starts from the model of a run of column shards: its first loss is
    that model's on its first batch (a cold start's is not); resuming it reads the
    checkpoint, not the file (gone by then). A file of another model is refused naming
    what differs, before any rank starts."""

    from recsz.data.source import make_source

    copy = tmp_path / "model.pt"
    shutil.copy(exported_model, copy)
    flags = ("--seed", "11", "--lr", "0.02", "--steps", "2", "--checkpoint-every", "2")
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    run(warm, *flags, "--init-from", str(copy), nproc=2)
    b = make_source("synthetic", SIZES, 11).train_batch(0, 64)
    logits = restored_logits(two_sharded, torch.as_tensor(b.dense), torch.as_tensor(b.ids))
    want = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.as_tensor(b.labels).float()
    )
    assert losses(warm)[0] == pytest.approx(float(want), rel=1e-5)
    run(cold, *flags)
    assert losses(cold)[0] != pytest.approx(float(want), rel=1e-3)
    copy.unlink()
    rc = main(["--resume", str(warm), "--steps", "4", "--no-progress"])
    assert rc == 0 and len(losses(warm)) == 4
    with pytest.raises(ValueError, match=r"model\.pt: its table_sizes are"):
        shutil.copy(exported_model, copy)
        main([*BASE, "--out", str(tmp_path / "x"), "--preset", "kaggle", "--init-from", str(copy)])


def torchrec_kjt(ids: torch.Tensor) -> object:
    """(B, 26) ids as TorchRec's DLRM takes them: feature cat_t, one id a bag."""
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"cat_{t}" for t in range(ids.shape[1])],
        values=ids.t().reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int32),
    )


def test_evaluate_a_checkpoint_on_any_number_of_ranks(
    single: Path, tmp_path: Path, criteo_10k: Path
) -> None:
    """`recsz evaluate RUN`: the run's model on its held-out set gives the run's own final
    numbers, on one process and on 2 ranks (tables resharded), each sample's prediction
    written in the set's order; on another file (the real sample), its labels and size."""
    from recsz.cli import main as cli

    want = json.loads((single / "summary.json").read_text())
    got = {}
    for n in (1, 2):
        out, preds = tmp_path / f"eval-{n}.json", tmp_path / f"preds-{n}.npy"
        argv = ["evaluate", str(single), "--nproc", str(n), "--json", str(out)]
        assert cli([*argv, "--predictions", str(preds)]) == 0
        got[n] = json.loads(out.read_text())
        assert got[n]["step"] == 20 and got[n]["world_size"] == n
        assert got[n]["eval_samples"] == 512
        for k in ("auc", "logloss", "accuracy"):
            assert got[n][k] == pytest.approx(want[k], abs=1e-6), (n, k)
    p1, p2 = (np.load(tmp_path / f"preds-{n}.npy") for n in (1, 2))
    assert p1.shape == (512, 2) and p1.dtype == np.float32
    np.testing.assert_allclose(p2, p1, rtol=0, atol=1e-6)
    preds = tmp_path / "real.npy"
    argv = ["evaluate", str(single), "--eval-data", str(criteo_10k), "--predictions", str(preds)]
    assert cli([*argv, "--eval-batch-size", "1000"]) == 0
    labels = [float(line.split("\t", 1)[0]) for line in criteo_10k.read_text().splitlines()]
    np.testing.assert_array_equal(np.load(preds)[:, 1], labels)
    assert cli(["evaluate", str(tmp_path / "none")]) == 2  # named, no traceback


def test_predict_scores_unlabeled_lines_as_evaluate_scores_them_labeled(
    single: Path, tmp_path: Path, criteo_10k: Path
) -> None:
    """`recsz predict RUN FILE... --out`: the real sample's lines with their labels cut
    (Criteo's test layout), split into a plain and a gzipped file, scored on one process
    (.npy) and on 2 ranks (text): each line's prediction is the one `recsz evaluate
    --predictions` gives its labeled line, in the files' order. A labeled file is named."""
    import gzip

    from recsz.cli import main as cli

    cut = [line.split("\t", 1)[1] for line in criteo_10k.read_text().splitlines(keepends=True)]
    a, b = tmp_path / "test-a.txt", tmp_path / "test-b.txt.gz"
    a.write_text("".join(cut[:4000]))
    with gzip.open(b, "wt") as f:
        f.write("".join(cut[4000:]))
    ref = tmp_path / "ref.npy"
    batch = ["--eval-batch-size", "1000"]  # the same batches: the codec bounds each batch
    assert cli(["evaluate", str(single), "--eval-data", str(criteo_10k), "--predictions",
                str(ref), *batch]) == 0  # fmt: skip
    want = np.load(ref)[:, 0]
    for n, name in ((1, "p.npy"), (2, "p.txt")):
        out, js = tmp_path / name, tmp_path / f"{name}.json"
        argv = ["predict", str(single), str(a), str(b), "--nproc", str(n), "--out", str(out)]
        assert cli([*argv, "--json", str(js), *batch]) == 0
        got = np.load(out) if name.endswith(".npy") else np.loadtxt(out, dtype=np.float32)
        assert got.shape == (9999,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        summary = json.loads(js.read_text())
        assert summary["eval_samples"] == 9999 and summary["world_size"] == n
        assert "auc" not in summary  # no labels: no numbers
    bad = ["predict", str(single), str(criteo_10k), "--out", str(tmp_path / "x.npy")]
    assert cli(bad) == 2  # a labeled line: its file and line named, no traceback
    assert not (tmp_path / "x.npy").exists()
    nowhere = ["predict", str(single), str(a), "--out", str(tmp_path / "no" / "p.npy")]
    assert cli(nowhere) == 2  # refused before scoring: no directory to write to
