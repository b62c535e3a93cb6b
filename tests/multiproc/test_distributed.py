"""Two gloo ranks on CPU, launched by `recsz train --nproc 2` (torchrun underneath).

Each test compares a distributed run with a single-process run of the same seed and
global batch, through the files the runs write (metrics.jsonl, checkpoints).
Embeddings use SGD here: Adagrad divides each row's gradient by its own magnitude, which
turns float-rounding differences in near-zero gradients into visible updates, so it
can only match to ~1e-3 (measured), not to float tolerance.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recsz import checkpoint
from recsz.devicepath import DEVICE_PATH_ON_CPU
from recsz.model import get_preset
from recsz.train import main

pytestmark = pytest.mark.slow
SIZES = get_preset("tiny").model.table_sizes

BASE = [
    "--steps",
    "20",
    "--batch-size",
    "64",
    "--log-every",
    "1",
    "--synthetic-eval",
    "512",
    "--no-progress",
    "--checkpoint-every",
    "20",
    "--seed",
    "5",
    "--emb-optimizer",
    "sgd",
]


def run(out: Path, *extra: str, nproc: int = 1) -> dict:
    rc = main([*BASE, "--out", str(out), "--nproc", str(nproc), *extra])
    assert rc == 0
    return json.loads((out / "summary.json").read_text())


def losses(out: Path) -> list[float]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def tables(out: Path, step: int = 20, shards: int = 1) -> dict[int, torch.Tensor]:
    """Every table's final weights (each column shard's), gathered from all ranks'
    checkpoint files."""
    d = out / "checkpoints" / f"step-{step:09d}"
    got: dict[int, torch.Tensor] = {}
    for f in sorted(d.glob("rank-*.pt")):
        s = torch.load(f, weights_only=False)
        sizes = [SIZES[t // shards] for t in s["tables"]]
        got.update(zip(s["tables"], s["sparse"]["weight"].split(sizes), strict=True))
    return got


def dense(out: Path, step: int = 20) -> dict[str, torch.Tensor]:
    d = out / "checkpoints" / f"step-{step:09d}"
    return torch.load(d / "rank-0.pt", weights_only=False)["dense"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    run(out)
    return out


def assert_same_model(a: Path, b: Path, tol: float) -> None:
    ta, tb = tables(a), tables(b)
    assert sorted(ta) == sorted(tb) == list(range(26))
    for t in ta:
        torch.testing.assert_close(ta[t], tb[t], rtol=0, atol=tol, msg=f"table {t}")
    da, db = dense(a), dense(b)
    for k in da:
        torch.testing.assert_close(da[k], db[k], rtol=0, atol=tol, msg=k)


def test_two_ranks_match_one_process(single: Path, tmp_path: Path) -> None:
    s = run(tmp_path, nproc=2)
    assert s["world_size"] == 2
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path)), torch.tensor(losses(single)), rtol=0, atol=1e-5
    )
    assert len(losses(tmp_path)) == 20
    assert_same_model(single, tmp_path, 1e-5)


def test_lossless_codec_is_exact_and_smaller(single: Path, tmp_path: Path) -> None:
    s = run(tmp_path, "--fwd-codec", "zstd", "--bwd-codec", "zstd", nproc=2)
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path)), torch.tensor(losses(single)), rtol=0, atol=1e-5
    )
    assert_same_model(single, tmp_path, 1e-5)
    assert 0 < s["bytes_sent"] < s["bytes_raw"] / 2
    assert s["bytes_payload"] < s["bytes_raw"]
    assert s["fwd_ratio"] > 1  # repeated rows; raw float gradients barely compress losslessly


def test_id_aware_traffic_is_exact_and_smaller(single: Path, tmp_path: Path) -> None:
    """Id dedup forward and gradient coalescing backward change bytes, not the model."""
    plain = tmp_path / "plain"
    p = run(plain, "--no-id-dedup", "--no-bwd-coalesce", nproc=2)
    aware = tmp_path / "aware"
    a = run(aware, "--id-dedup", "--bwd-coalesce", nproc=2)
    torch.testing.assert_close(
        torch.tensor(losses(aware)), torch.tensor(losses(plain)), rtol=0, atol=1e-5
    )
    assert_same_model(plain, aware, 1e-5)
    assert_same_model(single, aware, 1e-5)
    assert a["bytes_sent"] < 0.8 * p["bytes_sent"]
    assert a["bwd_ratio"] > 1.2 and a["fwd_ratio"] > 1.2


def test_hybrid_bounds_hold_on_every_chunk(tmp_path: Path) -> None:
    """--check-bounds decodes each payload on the sender and fails the run on a miss."""
    s = run(
        tmp_path,
        "--fwd-codec",
        "hybrid",
        "--bwd-codec",
        "hybrid",
        "--check-bounds",
        "--eb-mode",
        "abs",
        "--fwd-eb",
        "1e-4",
        "--bwd-eb",
        "1e-6",
        nproc=2,
    )
    assert s["fwd_ratio"] > 2 and s["bwd_ratio"] > 2
    assert 0.0 < s["max_err_over_eb"]["fwd"] <= 1.0 and 0.0 < s["max_err_over_eb"]["bwd"] <= 1.0
    assert 0.4 < s["auc"] < 1.0


def test_format_3_payloads_cross_ranks_within_their_bounds(tmp_path: Path) -> None:
    """--coder blocks: what GPUs send (one payload per destination, sizes read once),
    here between gloo ranks; id-aware traffic changes the group shapes every step."""
    s = run(
        tmp_path,
        *("--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--coder", "blocks"),
        *("--eb-policy", "dual", "--check-bounds", "--id-dedup", "--bwd-coalesce"),
        nproc=2,
    )
    assert s["fwd_ratio"] > 2 and s["bwd_ratio"] > 2
    assert 0.0 < s["max_err_over_eb"]["fwd"] <= 1.0 and 0.0 < s["max_err_over_eb"]["bwd"] <= 1.0
    assert 0.4 < s["auc"] < 1.0


HYBRID = ("--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--coder", "blocks",
          "--eb-policy", "dual")  # fmt: skip
FIXED = ("--no-id-dedup", "--no-bwd-coalesce")


@pytest.mark.parametrize(
    "flags",
    [HYBRID, HYBRID + FIXED, ("--fwd-codec", "fp16", "--bwd-codec", "fp16"), ("--dp-comm", "eb")],
    ids=["hybrid", "hybrid-fixed", "fp16", "dp-eb"],
)
def test_the_gpu_path_between_ranks_trains_as_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]
) -> None:
    """What GPUs send between ranks, here on the CPU (RECSZ_DEVICE_PATH_ON_CPU): format 3 by
    the device coder's Triton kernels under the interpreter (trimmed payloads, the received
    buffers' plans and checks; id-aware traffic changes the groups' shapes every step,
    fixed-size traffic reuses its plans; the eb hook's gradient buckets), and the casts'
    format 4 with no sizes exchanged. 2 ranks train exactly as with the host path (format
    3's CPU coder; format 1), but for the eb hook, whose host path is format 1:
    decoded, its values and format 3's differ in the last bits (measured: the tables by
    at most 2e-10 after 4 steps)."""
    ref = run(tmp_path / "ref", *flags, "--steps", "4", nproc=2)
    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")  # the ranks inherit it
    dev = run(tmp_path / "dev", *flags, "--steps", "4", nproc=2)
    want, got = tables(tmp_path / "ref", 4), tables(tmp_path / "dev", 4)
    assert got.keys() == want.keys()
    if "eb" in flags:  # format 1's values and format 3's, within one bound
        assert losses(tmp_path / "dev") == pytest.approx(losses(tmp_path / "ref"), rel=1e-6)
        for t in want:
            torch.testing.assert_close(got[t], want[t], rtol=1e-6, atol=1e-9)
        return
    assert losses(tmp_path / "dev") == losses(tmp_path / "ref") and dev["auc"] == ref["auc"]
    assert all(torch.equal(got[t], want[t]) for t in want)
    if flags[: len(HYBRID)] == HYBRID:  # format 3 both ways: the same bytes
        assert dev["bytes_sent"] == ref["bytes_sent"]


def tt_state(out: Path, step: int = 20) -> dict[str, object]:
    """Every rank's TT cores and their optimizers' state, from its checkpoint file."""
    d = out / "checkpoints" / f"step-{step:09d}"
    got: dict[str, object] = {}
    for f in sorted(d.glob("rank-*.pt")):
        sparse = torch.load(f, weights_only=False)["sparse"]
        got.update({f"{f.name}:{k}": v for k, v in sparse.items() if k.startswith("tt.")})
    return got


def one_and_two_ranks(tmp_path: Path, *flags: str) -> tuple[dict, dict]:
    """The summaries of one process and of 2 ranks with a lossless codec, whose losses
    must agree step by step."""
    one = run(tmp_path / "one", *flags)
    two = run(tmp_path / "two", *flags, "--fwd-codec", "zstd", "--bwd-codec", "zstd", nproc=2)
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "two")), torch.tensor(losses(tmp_path / "one")),
        rtol=0, atol=1e-5,
    )  # fmt: skip
    return one, two


def test_half_tables_on_two_ranks_match_one_process(single: Path, tmp_path: Path) -> None:
    """--table-dtype fp16: the updates' stochastic rounding draws from the values, not
    from a generator, so 2 ranks (lossless codec) train as one process does; the tables
    hold half the bytes."""
    one, two = one_and_two_ranks(tmp_path, "--table-dtype", "fp16")
    fp32 = json.loads((single / "summary.json").read_text())
    assert one["embedding_bytes"] == two["embedding_bytes"] == fp32["embedding_bytes"] // 2


def test_tt_tables_on_two_ranks_match_one_process(tmp_path: Path) -> None:
    """TT-Rec tables (the 5 largest, so both ranks hold some) with caches of hot rows
    (filled every 4 steps): 2 ranks with a lossless codec train exactly as one process;
    resuming from a checkpoint (between two fills) changes nothing."""
    tt = ("--tt-tables", "5", "--tt-rank", "3", "--emb-optimizer", "adagrad",
          "--tt-cache-rows", "8", "--tt-cache-interval", "4")  # fmt: skip
    one, two = one_and_two_ranks(tmp_path, *tt)
    assert one["embedding_bytes"] == two["embedding_bytes"] < one["embedding_bytes_dense"]
    assert one["tt_cache_hit_rate"] == two["tt_cache_hit_rate"] > 0
    split = tmp_path / "split"
    main([*BASE, *tt, "--steps", "10", "--checkpoint-every", "10", "--out", str(split)])
    shutil.copytree(split, tmp_path / "moved")
    assert main([*BASE, *tt, "--resume", str(split)]) == 0
    a, b = tt_state(tmp_path / "one"), tt_state(split)
    assert sorted(a) == sorted(b) and len(a) > 1
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    # Resumed on 2 ranks: the TT tables, their caches and optimizers move to their owners.
    run(tmp_path / "moved", *tt, "--resume", str(tmp_path / "moved"), nproc=2)
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "moved")), torch.tensor(losses(tmp_path / "one")),
        rtol=0, atol=1e-5,
    )  # fmt: skip


def test_replicated_tt_tables_leave_the_all_to_all(tmp_path: Path) -> None:
    """Replicated TT tables (on every rank, looked up for its own samples, core gradients
    averaged by DDP): 2 ranks with a lossless codec train as one process; the all-to-all
    carries only the other tables; a resumed run ends where a straight one does."""
    tt = ("--tt-tables", "5", "--tt-rank", "3", "--emb-optimizer", "adagrad")
    rep = (*tt, "--tt-placement", "replicated")
    one, two = one_and_two_ranks(tmp_path, *rep)
    sharded = run(tmp_path / "sharded", *tt, nproc=2)
    assert two["bytes_raw"] == sharded["bytes_raw"] * (26 - 5) // 26
    assert one["embedding_bytes_dense"] == two["embedding_bytes_dense"]
    split = tmp_path / "split"
    main([*BASE, *rep, "--steps", "10", "--checkpoint-every", "10", "--out", str(split)])
    assert main([*BASE, *rep, "--resume", str(split)]) == 0
    assert losses(split)[-10:] == losses(tmp_path / "one")[-10:]


def test_failing_rank_stops_the_job_fast(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "recsz.cli",
        "train",
        *BASE,
        "--steps",
        "50",
        "--nproc",
        "2",
        "--inject-failure",
        "1:3",
        "--dist-timeout",
        "30",
        "--out",
        str(tmp_path),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # a hang guard
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "injected failure on rank 1 at step 3" in out
    # rank 0 was stopped (its peer gone, or torchrun's signal), not left to its
    # collective's timeout
    assert "timed out" not in out.lower() and "timeout" not in out.lower().replace(
        "dist-timeout", ""
    ), out[-3000:]


def test_diverging_ranks_all_stop_at_the_same_row(tmp_path: Path) -> None:
    """Every rank reads every rank's loss in the row's one gather, so all stop together
    (no rank left waiting in a collective: a hang would run into the timeout), naming both
    ranks."""
    cmd = [sys.executable, "-m", "recsz.cli", "train", *BASE, "--nproc", "2", "--lr", "1e30",
           "--dist-timeout", "30", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "the loss is not finite on rank(s) [0, 1] by step 2" in p.stdout + p.stderr


def test_resume_equals_straight_run(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    run(straight, "--fwd-codec", "hybrid", "--bwd-codec", "hybrid", nproc=2)
    split = tmp_path / "split"
    main(
        [
            *BASE,
            "--steps",
            "10",
            "--checkpoint-every",
            "10",
            "--out",
            str(split),
            "--nproc",
            "2",
            "--fwd-codec",
            "hybrid",
            "--bwd-codec",
            "hybrid",
        ]
    )
    rc = main(
        [
            *BASE,
            "--resume",
            str(split),
            "--nproc",
            "2",
            "--fwd-codec",
            "hybrid",
            "--bwd-codec",
            "hybrid",
        ]
    )
    assert rc == 0
    assert_same_model(straight, split, 1e-6)

    # The resumed run reports the whole run: its log has each training step once, as the
    # straight run's, and its summary counts the bytes of every step.
    def logged(d: Path) -> list[int]:  # the training rows (evaluations add rows of their own)
        rows = [json.loads(r) for r in (d / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows if "loss" in r]

    assert logged(split) == logged(straight) == list(range(1, 21))
    a, b = (json.loads((d / "summary.json").read_text()) for d in (split, straight))
    for k in ("bytes_raw", "bytes_payload", "bytes_sent", "fwd_ratio", "bwd_ratio"):
        assert a[k] == b[k], k
    torch.testing.assert_close(
        torch.tensor(losses(split)[-10:]), torch.tensor(losses(straight)[-10:]), rtol=0, atol=1e-6
    )


def test_resume_on_another_number_of_ranks(single: Path, tmp_path: Path) -> None:
    """A checkpoint of 2 ranks resumed on one process, and one of one process resumed on 2
    ranks (a lossless codec): the tables move to the ranks the new plan gives them, and
    each run ends where the one-process run does (every step's loss, every table, the
    MLPs), its summary counting every step's bytes once."""
    zstd = ("--fwd-codec", "zstd", "--bwd-codec", "zstd")
    straight = run(tmp_path / "straight", *zstd)  # one process, its bytes
    for first, then in ((2, 1), (1, 2)):
        d = tmp_path / f"{first}-then-{then}"
        run(d, *zstd, "--steps", "10", "--checkpoint-every", "10", nproc=first)
        resumed = run(d, *zstd, "--resume", str(d), nproc=then)
        assert resumed["world_size"] == then
        torch.testing.assert_close(
            torch.tensor(losses(d)), torch.tensor(losses(single)), rtol=0, atol=1e-5
        )
        assert_same_model(single, d, 1e-5)
        assert resumed["bytes_raw"] == straight["bytes_raw"]  # (ratios: zstd's by chunk)


def test_a_resharded_resume_keeps_what_the_bound_policies_learnt(tmp_path: Path) -> None:
    """2 ranks with the dual-level bounds, resumed on one process: the forward policy holds
    each table's class and index as its old owner learnt them, the backward's those of old
    rank 0, and none probes anew (classes after the window, unchanged 2 steps later)."""
    flags = ("--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--eb-policy", "dual",
             "--hindex-probe-steps", "4")  # fmt: skip
    run(tmp_path, *flags, "--steps", "8", "--checkpoint-every", "8", nproc=2)
    run(tmp_path, *flags, "--resume", str(tmp_path), "--steps", "10")

    def policies(step: int, rank: int) -> dict:
        f = tmp_path / "checkpoints" / f"step-{step:09d}" / f"rank-{rank}.pt"
        return torch.load(f, weights_only=False)

    old = [policies(8, r) for r in (0, 1)]
    new = policies(10, 0)["policies"]
    for key in ("classes", "index"):
        fwd = {t: o["policies"]["fwd"][key][t] for o in old for t in o["tables"]}
        assert new["fwd"][key] == fwd and len(fwd) == len(SIZES), key
        assert new["bwd"][key] == old[0]["policies"]["bwd"][key], key
    assert new["fwd"]["again"] is None and new["bwd"]["again"] is None


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
    import shutil

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


def test_resume_checks_every_file_of_another_number_of_ranks(tmp_path: Path) -> None:
    """A checkpoint said to be written by 2 ranks, resumed on one: the file it lacks is
    named (every rank's file is read when the tables are resharded)."""
    run(tmp_path, "--steps", "2", "--checkpoint-every", "2")
    meta = next((tmp_path / "checkpoints").glob("step-*/meta.json"))
    m = json.loads(meta.read_text())
    m["world_size"] = 2  # as if 2 ranks had written it
    m["checksum"] = checkpoint.record_digest(m)
    meta.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"step-000000002/rank-1\.pt: missing"):
        main([*BASE, "--resume", str(tmp_path)])


def test_resume_refuses_other_config(tmp_path: Path) -> None:
    run(tmp_path, "--steps", "2", "--checkpoint-every", "2")
    with pytest.raises(ValueError, match=r"another configuration \(lr"):
        main([*BASE, "--resume", str(tmp_path), "--lr", "0.5"])


def test_incomplete_checkpoint_is_ignored(tmp_path: Path) -> None:
    run(tmp_path, "--steps", "4", "--checkpoint-every", "2")
    (tmp_path / "checkpoints" / "step-000000004" / "meta.json").unlink()  # crash mid-write
    from recsz import checkpoint

    assert checkpoint.complete(tmp_path)[-1].name == "step-000000002"


def test_dct_dp_keep_all_reproduces_ddp(single: Path, tmp_path: Path) -> None:
    """DCT-DP with keep fraction 1.0 sends every entry: the run equals plain DDP's."""
    plain = tmp_path / "plain"
    run(plain, nproc=2)
    dct = tmp_path / "dct"
    s = run(dct, "--dp-comm", "dct", "--dct-keep", "1.0", nproc=2)
    assert s["dp_threshold_refreshes"] >= 1
    assert losses(dct) == losses(plain)
    assert_same_model(plain, dct, 0.0)


def test_dct_mp_and_dp_train(tmp_path: Path) -> None:
    s = run(
        tmp_path,
        "--fwd-codec",
        "dct",
        "--bwd-codec",
        "dct-mask",
        "--dp-comm",
        "dct",
        "--dct-keep",
        "0.05",
        "--dct-refresh",
        "5",
        nproc=2,
    )
    assert s["fwd_ratio"] > 5 and s["bwd_ratio"] > 5 and s["dp_ratio"] > 5
    assert 0.3 < s["auc"] < 1.0


def test_ranks_with_different_configs_refuse_to_start(tmp_path: Path) -> None:
    """Two ranks started by hand (as a multi-node launcher would) with different --lr."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, lr in ((0, "0.1"), (1, "0.2")):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "recsz.train", *BASE, "--lr", lr, "--dist-timeout", "30"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert any("ranks [1] were started with a configuration that differs" in o for o in outs)


@pytest.mark.parametrize("mode", ["fp16", "bf16", "powersgd", "eb", "eb-rsag"])
def test_every_dp_hook_trains_and_counts_its_bytes(single: Path, tmp_path: Path, mode: str) -> None:
    """Each hook's run stays near the plain all-reduce's (``single`` equals it), sending
    fewer bytes."""
    flags = ["--dp-comm", mode, "--powersgd-warmup", "5"]
    if mode == "eb-rsag":
        flags = ["--dp-comm", "eb", "--dp-eb-collective", "rsag"]
    s = run(tmp_path, *flags, nproc=2)
    assert s["allreduce_bytes"] > 0 and s["allreduce_s"] > 0
    assert s["dp_ratio"] > (1.9 if mode != "powersgd" else 1.5), s["dp_ratio"]
    ours, plain = losses(tmp_path), losses(single)
    assert all(math.isfinite(v) for v in ours)
    assert max(abs(a - b) for a, b in zip(ours, plain, strict=True)) < 0.05


def test_eb_hook_with_a_lossless_codec_equals_the_all_reduce(single: Path, tmp_path: Path):
    plain = tmp_path / "plain"
    run(plain, nproc=2)
    for collective in ("allgather", "rsag"):
        eb = tmp_path / collective
        flags = ("--dp-codec", "none", "--dp-eb-collective", collective)
        run(eb, "--dp-comm", "eb", *flags, nproc=2)
        assert losses(eb) == losses(plain)
        assert_same_model(plain, eb, 0.0)


@pytest.mark.parametrize("mode", ["eb", "dct", "rsag"])
def test_resume_keeps_the_hooks_error_feedback(tmp_path: Path, mode: str) -> None:
    """A run split by a checkpoint ends where a straight one does: the hook's residuals
    travel in the checkpoint, per parameter (DDP's buckets are laid out anew)."""
    flags = ["--dp-comm", mode, "--powersgd-warmup", "3", "--nproc", "2"]
    if mode == "rsag":
        flags = ["--dp-comm", "eb", "--dp-eb-collective", "rsag", "--nproc", "2"]
    straight = tmp_path / "straight"
    run(straight, *flags[:-2], nproc=2)
    split = tmp_path / "split"
    main([*BASE, "--steps", "10", "--checkpoint-every", "10", "--out", str(split), *flags])
    assert main([*BASE, "--resume", str(split), *flags]) == 0
    assert losses(split)[-10:] == losses(straight)[-10:]
    assert_same_model(straight, split, 0.0)


def fiited_tables(out: Path, step: int = 20) -> dict[int, torch.Tensor]:
    """Every table's rows as FIITED's stores hold them (pruned chunks zero), all ranks."""
    d = out / "checkpoints" / f"step-{step:09d}"
    got: dict[int, torch.Tensor] = {}
    for f in sorted(d.glob("rank-*.pt")):
        s = torch.load(f, weights_only=False)
        base, count = s["sparse"]["store.base"].long(), s["sparse"]["store.count"].long()
        pool = s["sparse"]["store.pool"]  # row r's chunk j at base[r] + j, if j < count[r]
        k = get_preset("tiny").model.emb_dim // pool.shape[1]
        held = torch.arange(k) < count.unsqueeze(1)
        full = torch.zeros(len(base), k, pool.shape[1])
        full[held] = pool[(base.unsqueeze(1) + torch.arange(k))[held]]
        sizes = [SIZES[t] for t in s["tables"]]
        got.update(zip(s["tables"], full.flatten(1).split(sizes), strict=True))
    return got


def test_fiited_two_ranks_match_one_process_and_resume(tmp_path: Path) -> None:
    """FIITED prunes per table, so sharding changes nothing: 2 ranks with a lossless codec
    equal 1 process, and a run resumed from a checkpoint between prunings equals it too,
    on one process or on 2 ranks."""
    flags = ["--fiited-budget", "0.4", "--fiited-interval", "6", "--checkpoint-every", "10"]
    one, two = one_and_two_ranks(tmp_path, *flags)
    ta, tb = fiited_tables(tmp_path / "one"), fiited_tables(tmp_path / "two")
    for t in range(26):
        torch.testing.assert_close(ta[t], tb[t], rtol=0, atol=1e-5, msg=f"table {t}")
        assert torch.equal(ta[t] == 0, tb[t] == 0), f"table {t}: other chunks pruned"
    assert one["embedding_bytes"] == two["embedding_bytes"] < 0.6 * one["embedding_bytes_dense"]
    split = tmp_path / "split"
    main([*BASE, *flags, "--steps", "10", "--out", str(split)])
    shutil.copytree(split, tmp_path / "moved")
    assert main([*BASE, *flags, "--resume", str(split)]) == 0
    for t, rows in fiited_tables(split).items():
        assert torch.equal(rows, ta[t]), f"table {t}"
    # Resumed on 2 ranks: each table's chunks, counts, scores move to its new owner.
    run(tmp_path / "moved", *flags, "--resume", str(tmp_path / "moved"), nproc=2)
    for t, rows in fiited_tables(tmp_path / "moved").items():
        torch.testing.assert_close(rows, ta[t], rtol=0, atol=1e-5, msg=f"table {t}")
        assert torch.equal(rows == 0, ta[t] == 0), f"table {t}: other chunks pruned"


def test_fiited_backward_mask_sends_fewer_bytes_and_changes_no_update(tmp_path: Path) -> None:
    """With the pruned chunks known to every rank, their gradients travel as zeros: the
    same training (the owner discarded them anyway; a static uniform pruning, so the
    scores decide nothing), fewer backward bytes."""
    flags = ["--fiited-budget", "0.5", "--fiited-rule", "uniform", "--fwd-codec", "zstd",
             "--bwd-codec", "zstd", "--emb-optimizer", "adagrad"]  # fmt: skip
    plain = run(tmp_path / "plain", *flags, nproc=2)
    masked = run(tmp_path / "masked", *flags, "--fiited-mask-backward", nproc=2)
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "masked")), torch.tensor(losses(tmp_path / "plain")),
        rtol=0, atol=1e-6,
    )  # fmt: skip
    ta, tb = fiited_tables(tmp_path / "plain"), fiited_tables(tmp_path / "masked")
    for t in range(26):
        torch.testing.assert_close(ta[t], tb[t], rtol=0, atol=1e-6, msg=f"table {t}")
    assert masked["bwd_ratio"] > 1.5 * plain["bwd_ratio"]


def test_multi_hot_bags_on_two_ranks_match_one_process(tmp_path: Path) -> None:
    """MLPerf's bags (214 ids a sample): 2 ranks with a lossless codec train as one
    process; id-aware traffic (one vector a distinct one-hot id, so one a distinct bag)
    changes bytes, not the model."""
    _, two = one_and_two_ranks(tmp_path, "--multi-hot", "mlperf")
    plain = tmp_path / "plain"
    lossless = ("--fwd-codec", "zstd", "--bwd-codec", "zstd")
    p = run(plain, "--multi-hot", "mlperf", *lossless, "--no-id-dedup", "--no-bwd-coalesce",
            nproc=2)  # fmt: skip
    assert_same_model(tmp_path / "one", tmp_path / "two", 1e-5)
    assert_same_model(plain, tmp_path / "two", 1e-5)
    assert two["bytes_sent"] < p["bytes_sent"]  # id-aware: fewer vectors
    single = tmp_path / "onehot"
    run(single)
    assert tables(single)[20].ne(tables(tmp_path / "one")[20]).any()  # the bags do train


def test_dcn_and_dense_adagrad_on_two_ranks_match_one_process_and_resume(tmp_path: Path):
    """DCNv2's cross layers (--interaction dcn) with Adagrad on the MLPs (MLPerf's
    DLRM-DCNv2): 2 ranks with a lossless codec train as one process (the cross layers'
    gradients all-reduced with the MLPs'); the cross layers are in the checkpoint and learn;
    a run resumed at step 10 (Adagrad's sums restored) equals the straight one."""
    flags = ("--interaction", "dcn", "--dcn-layers", "2", "--dcn-rank", "32")
    flags += ("--dense-optimizer", "adagrad", "--lr", "0.01")
    one_and_two_ranks(tmp_path, *flags)
    # Adagrad divides each gradient by the root of its squares' sum: where those are tiny,
    # the all-reduce's other order of sums moves an update by up to ~lr/100 (one element
    # in 10^4 here), not only by float32's rounding as SGD does.
    assert_same_model(tmp_path / "one", tmp_path / "two", 1e-4)
    got = dense(tmp_path / "two")
    assert got["cross.W.1"].shape == (27 * 16, 32) and got["cross.b.0"].abs().sum() > 0
    ckpt = tmp_path / "two" / "checkpoints" / f"step-{20:09d}" / "rank-0.pt"
    assert "sum" in torch.load(ckpt, weights_only=False)["dense_opt"]["state"][0]  # Adagrad's
    split = tmp_path / "split"
    run(split, *flags, "--steps", "10", "--checkpoint-every", "10")
    assert main([*BASE, *flags, "--resume", str(split)]) == 0
    assert_same_model(tmp_path / "one", split, 1e-6)


def test_compress_auto_switches_ways_and_stays_exact(single: Path, tmp_path: Path) -> None:
    """--compress auto with a lossless codec: two trials (steps 0-7, with the first's
    warm-up, and 10-13 at least) alternate zstd and the plain exchange step by step, every
    rank alike, and the model is the single process's whichever way each step went."""
    s = run(
        tmp_path,
        *("--fwd-codec", "zstd", "--bwd-codec", "zstd", "--compress", "auto"),
        *("--compress-trial", "2", "--compress-every", "10"),
        nproc=2,
    )
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path)), torch.tensor(losses(single)), rtol=0, atol=1e-5
    )
    assert_same_model(single, tmp_path, 1e-5)
    switch = s["compress"]
    assert [t["step"] for t in switch["trials"]] == [0, 10]
    assert all(t["compressed_s"] > 0 and t["plain_s"] > 0 for t in switch["trials"])
    steps = switch["steps"]
    assert steps["compressed"] + steps["plain"] == 20 and min(steps.values()) >= 6
    # resumed from its checkpoint: the switch goes on (its trials, counts and schedule),
    # rather than opening a trial of its own at the first step
    flags = ("--fwd-codec", "zstd", "--bwd-codec", "zstd", "--compress", "auto")
    flags += ("--compress-trial", "2", "--compress-every", "10")
    assert main([*BASE, *flags, "--steps", "30", "--resume", str(tmp_path), "--nproc", "2"]) == 0
    again = json.loads((tmp_path / "summary.json").read_text())["compress"]
    assert again["trials"][:2] == switch["trials"]
    assert sum(again["steps"].values()) == 30


def _conflicting_clocks(rank: int, store: str, out: str) -> None:
    """Rank 0's steps say compress (1 s against 2 s plain), rank 1's say the opposite by
    more (5 s against 1 s): the ranks' maxima (5 s, 2 s) choose plain on both."""
    import torch.distributed as dist

    from recsz.comm.switch import CompressionSwitch, max_over

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    now = [0.0]
    switch = CompressionSwitch(
        "auto", trial=2, every=0, warmup=0, agree=max_over(None), clock=lambda: now[0]
    )
    ways = []
    for step in range(10):
        ways.append(switch.compress(step))
        now[0] += (1.0 if ways[-1] else 2.0) if rank == 0 else (5.0 if ways[-1] else 1.0)
    torch.save({"ways": ways, "trials": switch.trials}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_ranks_with_conflicting_step_times_choose_alike() -> None:
    from tests.multiproc.spawned import spawned

    got = spawned(_conflicting_clocks, 2)
    assert got[0] == got[1]
    assert got[0]["ways"] == [True, False] * 2 + [False] * 6
    assert (got[0]["trials"][0]["compressed_s"], got[0]["trials"][0]["plain_s"]) == (5.0, 2.0)
