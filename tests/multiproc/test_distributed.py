"""Two gloo ranks on CPU, launched by `recsz train --nproc 2` (torchrun underneath), train
as one process does: every kind of table, both interactions, bags, the codecs and the
GPU's code path (the runs' helpers: runs.py; resumed runs: test_resume.py; the dense
part's hooks: test_dense_comm.py; what a run's model is used for: test_models_out.py).
Each test compares a distributed run with a single-process run of the same seed and
global batch, through the files the runs write (metrics.jsonl, checkpoints).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from recsz.devicepath import DEVICE_PATH_ON_CPU
from recsz.model import get_preset
from recsz.train import main
from tests.multiproc.runs import (
    BASE,
    SIZES,
    assert_same_model,
    dense,
    losses,
    one_and_two_ranks,
    run,
    run_on_hosts,
    tables,
)

pytestmark = pytest.mark.slow


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


def test_two_hosts_of_two_ranks_match_one_process(single: Path, tmp_path: Path) -> None:
    """4 ranks on two torchrun agents, as on two machines: the codec codes what crosses
    hosts only (``--compress-scope auto``; tests/test_compressscope.py checks the blocks
    within a host go plain), the MLP gradients summed within each host and coded across
    (``--dp-eb-collective hosts``; tests/test_dp_hosts.py), and with lossless codecs they
    train as one process does; the bytes between hosts are counted apart."""
    s = run_on_hosts(tmp_path, "--fwd-codec", "zstd", "--bwd-codec", "zstd", "--dp-comm", "eb",
                     "--dp-codec", "zstd", "--dp-eb-collective", "hosts")  # fmt: skip
    assert s["world_size"] == 4
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path)), torch.tensor(losses(single)), rtol=0, atol=1e-5
    )
    assert_same_model(single, tmp_path, 1e-5)
    assert 0 < s["bytes_between_hosts"] < s["bytes_sent"]


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
