"""Checkpoints in one process: verified on resume (damage, truncation, a foreign run),
pruned, never leaving temporary files, and a resumed run's bookkeeping."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from recsz import checkpoint
from recsz.rundir import WRITER
from recsz.runoptions import CONFIG_VERSION
from recsz.train import main

BASE = ["--steps", "4", "--batch-size", "32", "--checkpoint-every", "2", "--no-progress",
        "--synthetic-eval", "256", "--log-every", "1"]  # fmt: skip


#: the host, and a GPU where there is one
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]  # fmt: skip


def train(out: Path, *extra: str) -> dict:
    assert main([*BASE, "--out", str(out), *extra]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    train(out)
    return out


def flipped(src: Path, tmp: Path, at: int) -> Path:
    """A copy of run ``src`` whose newest checkpoint has byte ``at`` of a file flipped
    (``at`` counts through rank-0.pt, then meta.json)."""
    import shutil

    dst = tmp / f"flip-{at}"
    shutil.copytree(src, dst)
    d = checkpoint.complete(dst)[-1]
    assert d is not None
    rank, meta = d / "rank-0.pt", d / "meta.json"
    f, i = (rank, at) if at < rank.stat().st_size else (meta, at - rank.stat().st_size)
    data = bytearray(f.read_bytes())
    data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    return dst


def test_flipped_bytes_are_refused_with_the_file_named(run_dir: Path, tmp_path: Path) -> None:
    d = checkpoint.complete(run_dir)[-1]
    assert d is not None
    n_rank = (d / "rank-0.pt").stat().st_size
    n = n_rank + (d / "meta.json").stat().st_size
    rng = random.Random(0)
    spots = [0, n_rank - 1, n_rank, n - 1, *rng.sample(range(n), 6)]
    for at in spots:
        bad = flipped(run_dir, tmp_path, at)
        name = "rank-0.pt" if at < n_rank else "meta.json"
        with pytest.raises(ValueError, match=rf"step-000000004/{name}"):
            main([*BASE, "--steps", "6", "--resume", str(bad)])


def test_every_byte_flip_changes_the_digest_checked(run_dir: Path) -> None:
    """The check behind the refusals, for every byte of the (small) record and a dense
    sample of the state file, without loading a run each time."""
    d = checkpoint.complete(run_dir)[-1]
    assert d is not None
    meta = (d / "meta.json").read_bytes()
    for i in range(len(meta)):
        data = bytearray(meta)
        data[i] ^= 0x01
        try:
            m = json.loads(bytes(data))
            ok = isinstance(m, dict) and m.get("checksum") == checkpoint.record_digest(m)
        except ValueError:
            ok = False
        assert not ok, f"flip at byte {i} of meta.json goes unnoticed"


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 200, 256])
def test_a_file_s_digest_is_its_pieces_digest(
    size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHA-256 over each piece's SHA-256 (pieces of 64 bytes here, hashed on threads), or
    one SHA-256 of the whole file (a record written before the pieces)."""
    import hashlib

    monkeypatch.setattr(checkpoint, "_PIECE", 64)
    data = random.Random(size).randbytes(size)
    f = tmp_path / "f"
    f.write_bytes(data)
    pieces = [data[i : i + 64] for i in range(0, max(size, 1), 64)]
    want = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()
    assert checkpoint.digest(f) == want
    assert checkpoint.digest(f, None) == hashlib.sha256(data).hexdigest()


def test_a_record_from_before_the_pieces_still_resumes(run_dir: Path, tmp_path: Path) -> None:
    """A record without "digest" holds one SHA-256 of each whole file; an unknown way of
    digesting is named."""
    import hashlib
    import shutil

    for how, ok in [(None, True), ("sha3-of-something", False)]:
        dst = tmp_path / f"old-{how}"
        shutil.copytree(run_dir, dst)
        d = checkpoint.complete(dst)[-1]
        meta = json.loads((d / "meta.json").read_text())
        del meta["digest"]
        if how is None:
            meta["files"] = {n: hashlib.sha256((d / n).read_bytes()).hexdigest()
                             for n in meta["files"]}  # fmt: skip
        else:
            meta["digest"] = how
        meta["checksum"] = checkpoint.record_digest(meta)
        (d / "meta.json").write_text(json.dumps(meta))
        if ok:
            assert train(dst, "--steps", "6", "--resume", str(dst))["steps"] == 6
        else:
            with pytest.raises(ValueError, match="digest 'sha3-of-something' unknown"):
                main([*BASE, "--steps", "6", "--resume", str(dst)])


def test_fallback_resumes_from_the_last_intact_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    """A run's newest checkpoint damaged: its resume says --resume-fallback, which goes on
    from the one before; `recsz evaluate` (which takes the newest), and a resume naming the
    damaged one, name the older one instead (they take no --resume-fallback)."""
    from recsz.evaluation import main as evaluate

    bad = flipped(run_dir, tmp_path, 100)
    with pytest.raises(ValueError, match="--resume-fallback: the last intact one"):
        main([*BASE, "--steps", "6", "--resume", str(bad)])
    older = f"an older one may be intact: name it, {bad}/checkpoints/step-000000002\\)$"
    with pytest.raises(ValueError, match=older):
        evaluate([str(bad)])
    with pytest.raises(ValueError, match=older):
        main([*BASE, "--steps", "6", "--resume", str(checkpoint.complete(bad)[-1])])
    s = train(bad, "--steps", "6", "--resume", str(bad), "--resume-fallback")
    assert s["steps"] == 6
    steps = [json.loads(r)["step"] for r in (bad / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(3) == 1 and steps.count(4) == 1  # rerun from step 2, once each


def test_a_row_cut_short_by_a_kill_is_dropped_on_resume(run_dir: Path, tmp_path: Path) -> None:
    """A run killed while writing a metrics row leaves its last line cut short: resuming
    drops it (and writes the steps after the checkpoint again); a damaged line elsewhere is
    named by file and line, for the resume and for `recsz plot`."""
    import shutil

    from recsz.plot import plot_run

    dst = tmp_path / "torn"
    shutil.copytree(run_dir, dst)
    log = dst / "metrics.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 5, "loss": 0.6')  # the kill's half row
    train(dst, "--steps", "6", "--resume", str(dst))
    steps = [json.loads(r)["step"] for r in log.read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(5) == 1 and steps[-1] == 6
    dst = tmp_path / "damaged"  # its newest checkpoint at step 4 again
    shutil.copytree(run_dir, dst)
    log = dst / "metrics.jsonl"
    lines = whole.splitlines(keepends=True)
    log.write_text("".join([*lines[:2], '{"step": 2, "lo\n', *lines[2:]]))
    with pytest.raises(ValueError, match=r"damaged/metrics\.jsonl, line 3: not a JSON row"):
        main([*BASE, "--steps", "6", "--resume", str(dst)])
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 3: not a JSON row"):
        plot_run(dst)
    log.write_text("".join([*lines[:2], "[2, 3]\n", *lines[2:]]))
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 3: not a JSON object"):
        plot_run(dst)


def signalled_in(monkeypatch: pytest.MonkeyPatch, at: int, sig: int) -> None:
    """The run's process sent ``sig`` as its step ``at`` begins (as a scheduler or Ctrl-C
    would, between two of its calls)."""
    import os

    import recsz.train

    stepped = recsz.train.train_step

    def signalled(parts, batch, step, ranks):  # type: ignore[no-untyped-def]
        if step == at:
            os.kill(os.getpid(), sig)
        return stepped(parts, batch, step, ranks)

    monkeypatch.setattr(recsz.train, "train_step", signalled)


@pytest.mark.parametrize("device", DEVICES)
def test_sigterm_stops_at_a_checkpoint_the_run_resumes_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """SIGTERM mid-run (a scheduler's preemption): the step under way ends, a checkpoint is
    written at it (between --checkpoint-every's; on a GPU by the background writer), the run
    exits with SIGTERM's status without evaluating, and SIGTERM's handler is the caller's
    again; resumed, the run ends where a straight one does. Without a run directory (nowhere
    to save) SIGTERM is left alone."""
    import signal

    import recsz.train

    stepped = recsz.train.train_step
    signalled_in(monkeypatch, 3, signal.SIGTERM)
    before = signal.getsignal(signal.SIGTERM)
    run = tmp_path / "run"
    on = ["--device", device]
    assert main([*BASE, *on, "--steps", "8", "--checkpoint-every", "6", "--out", str(run)]) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    assert [d.name for d in checkpoint.complete(run)] == ["step-000000004"]
    assert not (run / "summary.json").exists()
    monkeypatch.setattr(recsz.train, "train_step", stepped)
    resumed = train(run, "--steps", "8", "--checkpoint-every", "6", "--resume", str(run))
    straight = train(tmp_path / "straight", *on, "--steps", "8", "--checkpoint-every", "6")
    for k in ("auc", "logloss", "bytes_raw"):
        assert resumed[k] == pytest.approx(straight[k], rel=1e-6), k
    assert [d.name for d in checkpoint.complete(run)] == [f"step-00000000{s}" for s in (4, 6, 8)]
    seen = []

    def handler_seen(parts, batch, step, ranks):  # type: ignore[no-untyped-def]
        seen.append(signal.getsignal(signal.SIGTERM))
        return stepped(parts, batch, step, ranks)

    monkeypatch.setattr(recsz.train, "train_step", handler_seen)
    assert main([*BASE, *on]) == 0 and seen and all(h is before for h in seen)


@pytest.mark.usefixtures("ctrl_c_heard")
def test_ctrl_c_saves_a_run_with_a_directory_and_ends_one_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGINT (Ctrl-C) mid-run: with a run directory, as SIGTERM, the step under way ends, a
    checkpoint is written there and the run exits with SIGINT's status (130); without one
    (nowhere to save), `recsz train` ends at once with 130, saying so, no traceback."""
    import signal

    from recsz.cli import main as cli

    signalled_in(monkeypatch, 3, signal.SIGINT)
    run = tmp_path / "run"
    assert main([*BASE, "--steps", "8", "--checkpoint-every", "6", "--out", str(run)]) == 130
    assert [d.name for d in checkpoint.complete(run)] == ["step-000000004"]
    assert "stopped at step 4 (SIGINT)" in capsys.readouterr().out
    assert cli(["train", "--steps", "8", "--batch-size", "32", "--no-progress"]) == 130
    assert capsys.readouterr().err.strip() == "recsz train: interrupted"


def test_a_second_ctrl_c_during_a_checkpoints_write_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt while a rank writes its checkpoint's file (a second Ctrl-C): the
    run ends with it (not as a checkpoint that could not be written), no partial file
    left, nothing completed."""
    import recsz.checkpointwrite

    def interrupted(state: object, f: object) -> None:
        Path(str(f)).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(recsz.checkpointwrite.torch, "save", interrupted)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        main([*BASE, "--out", str(run)])
    assert checkpoint.complete(run) == [] and not list(run.glob("checkpoints/*/*"))


def test_the_same_run_again_goes_on_and_another_is_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out holding this run (the command line run again, as a requeued job): it goes on
    from its last checkpoint, ending where one run would; without a checkpoint it starts
    over. Holding another run (another configuration, or --resume naming another run): refused,
    what it holds left as it was. An empty directory is taken."""
    import shutil

    def files(d: Path) -> dict[str, bytes]:  # (but the lock each run takes: rundir.WRITER)
        return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != WRITER}

    dst = tmp_path / "held"
    shutil.copytree(run_dir, dst)
    before = files(dst)
    with pytest.raises(ValueError, match=r"--out .*held holds another run \(its checkpoint "
                       r"step-000000004 was written with lr: None -> 0\.5\); continue that "
                       r"one with `--resume "):  # fmt: skip
        main([*BASE, "--lr", "0.5", "--out", str(dst)])
    with pytest.raises(ValueError, match="already holds a run"):  # resuming another run
        main([*BASE, "--steps", "6", "--resume", str(run_dir), "--out", str(dst)])
    assert files(dst) == before
    capsys.readouterr()
    assert main([*BASE, "--out", str(dst)]) == 0  # finished: nothing to do
    assert "already finished" in capsys.readouterr().out
    assert files(dst) == before
    half = tmp_path / "half"  # stopped at step 2 of 4 (the job preempted, say)
    train(half, "--steps", "2")
    again = train(half)  # the job's command line again: steps 2..4
    assert "holds this run's checkpoint at step 2: going on" in capsys.readouterr().out
    straight = json.loads((run_dir / "summary.json").read_text())
    for k in ("auc", "logloss", "bytes_raw"):
        assert again[k] == pytest.approx(straight[k], rel=1e-6), k
    bare = tmp_path / "bare"  # this run without checkpoints: it starts over
    first = train(bare, "--checkpoint-every", "0")
    assert train(bare, "--checkpoint-every", "0")["auc"] == first["auc"]
    with pytest.raises(ValueError, match=r"its config\.json says lr: None -> 0\.5\); write "
                       r"this one elsewhere"):  # (nothing to --resume from there)  # fmt: skip
        main([*BASE, "--checkpoint-every", "0", "--lr", "0.5", "--out", str(bare)])
    (tmp_path / "empty").mkdir()
    train(tmp_path / "empty")


def test_a_run_written_by_another_job_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job writing a run holds its directory (rundir.Held): the same command line started
    beside it is refused, naming it, before it writes anything; the lock is dropped when its
    holder ends, however it ends (here: SIGKILL), and where a file system keeps no locks
    the run is said to go unguarded, and trains."""
    import errno
    import fcntl
    import signal
    import subprocess
    import sys

    from recsz.rundir import Held

    run = tmp_path / "run"
    other = Held(run)  # (a job writing it)
    assert other.refused is None
    said = rf"--out {run} is being written by another job \(pid \d+ on .+, since .+\): two jobs"
    with pytest.raises(ValueError, match=said):
        main([*BASE, "--out", str(run)])
    assert sorted(p.name for p in run.iterdir()) == [WRITER]  # nothing written
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        main([*BASE, "--resume", str(tmp_path / "missing")])
    assert not (tmp_path / "missing").exists()  # (not made to be held)
    other.release()
    train(run)
    cmd = [sys.executable, "-c", "import sys, time; from pathlib import Path; from recsz.rundir "
           "import Held; h = Held(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)",
           str(run)]  # fmt: skip

    def refused() -> bool:
        tried = Held(run)
        tried.release()
        return tried.refused is not None

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert refused()
        holder.send_signal(signal.SIGKILL)
    assert not refused()  # the lock dropped with its holder

    def no_locks(f: object, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    capsys.readouterr()
    train(tmp_path / "unlocked")
    assert "cannot lock" in capsys.readouterr().err


def test_a_finished_run_without_its_summary_is_evaluated_again(
    run_dir: Path, tmp_path: Path
) -> None:
    """Stopped during its final evaluation (a preemption there), a run that trained all its
    steps has its last checkpoint but no summary: its command line again evaluates that
    checkpoint and writes the summary the run would have (with a summary: nothing to do)."""
    import shutil

    dst = tmp_path / "unsummarized"
    shutil.copytree(run_dir, dst)
    (dst / "summary.json").unlink()
    log = dst / "metrics.jsonl"  # killed during the evaluation: its row not written either
    kept = [r for r in log.read_text().splitlines() if "eval_auc" not in r]
    log.write_text("".join(r + "\n" for r in kept))
    again = train(dst)
    want = json.loads((run_dir / "summary.json").read_text())
    for k in ("auc", "logloss", "steps", "bytes_raw", "fwd_ratio"):
        assert again[k] == pytest.approx(want[k], rel=1e-9), k
    rows = [json.loads(r) for r in (dst / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_auc" in r] == [4]  # its evaluation once


def test_an_evaluation_due_at_a_checkpoint_follows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint of a step where an evaluation is due is written before it, so a job
    stopped or killed during that evaluation goes on from that step: resumed, it evaluates
    there first (its row missing from the log), or not (the row there); every way ends with
    a straight run's numbers and each evaluation's row once."""
    import os
    import shutil
    import signal

    import recsz.train

    every = ["--steps", "6", "--eval-every", "2", "--checkpoint-every", "2"]

    def evals(run: Path) -> list[tuple[int, float]]:
        rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["eval_auc"]) for r in rows if "eval_auc" in r]

    straight = train(tmp_path / "straight", *every)
    want = evals(tmp_path / "straight")
    assert [s for s, _ in want] == [2, 4, 6]
    stepped = recsz.train.train_step

    def stopped_at_4(parts, batch, step, ranks):  # type: ignore[no-untyped-def]
        if step == 3:  # the step that ends at 4, where an evaluation is due
            os.kill(os.getpid(), signal.SIGTERM)
        return stepped(parts, batch, step, ranks)

    monkeypatch.setattr(recsz.train, "train_step", stopped_at_4)
    run = tmp_path / "stopped"
    assert main([*BASE, *every, "--out", str(run)]) == 143
    assert [s for s, _ in evals(run)] == [2]  # the stop skipped the evaluation at 4
    monkeypatch.setattr(recsz.train, "train_step", stepped)
    shutil.copytree(run, tmp_path / "stopped-target")
    assert train(run, *every) and evals(run) == want
    said = capsys.readouterr().out
    assert "the evaluation due at step 4 did not end before the run stopped" in said
    failed = tmp_path / "failed"  # the evaluation at 4 logged, then a failure in step 5
    with pytest.raises(RuntimeError, match="injected failure"):
        main([*BASE, *every, "--out", str(failed), "--inject-failure", "0:4"])
    assert [s for s, _ in evals(failed)] == [2, 4]
    assert [d.name for d in checkpoint.complete(failed)][-1] == "step-000000004"  # whole
    again = train(failed, *every)
    assert evals(failed) == want  # not evaluated at 4 again
    for k in ("auc", "logloss", "steps", "bytes_raw"):
        assert again[k] == pytest.approx(straight[k], rel=1e-9), k
    # its target met by the evaluation after a checkpoint: the same line again ends there
    target = ["--target-auc", str(want[1][1] - 1e-9)]
    reached = train(tmp_path / "target", *every, *target)
    assert reached["reached_target_at"] == 4 and evals(tmp_path / "target") == want[:2]
    assert main([*BASE, *every, *target, "--out", str(tmp_path / "target")]) == 0
    assert evals(tmp_path / "target") == want[:2]
    unsaved = train(tmp_path / "target-0", *every, *target, "--checkpoint-every", "0")
    assert unsaved["reached_target_at"] == 4 and checkpoint.complete(tmp_path / "target-0") == []
    # stopped before the evaluation that meets the target: resumed, it evaluates and ends
    resumed = train(tmp_path / "stopped-target", *every, *target)
    assert resumed["reached_target_at"] == 4 and evals(tmp_path / "stopped-target") == want[:2]
    assert resumed["auc"] == pytest.approx(reached["auc"], rel=1e-9)


def test_on_the_cpu_a_checkpoint_is_complete_once_written(tmp_path: Path) -> None:
    """On the CPU every rank writes its checkpoint's file at once, so the checkpoint is
    completed then, not at the next logged row: a failure in between keeps it (before, with
    rows logged every 100 steps, a crash in step 3 lost the checkpoint at 2)."""
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure"):
        main([*BASE, "--log-every", "100", "--out", str(run), "--inject-failure", "0:2"])
    assert [d.name for d in checkpoint.complete(run)] == ["step-000000002"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_killed_in_its_final_evaluation_is_evaluated_from_its_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The last step's checkpoint is complete before the final evaluation starts (on a GPU,
    its background write waited for): a run that dies during it (here the evaluation
    raises) is, run again, evaluated from there, not trained again from the one before."""
    import recsz.train

    evaluate = recsz.train.evaluate

    def dies_at_the_end(parts, source, cfg, step, ranks, **kw):  # type: ignore[no-untyped-def]
        if step == 4:
            raise KeyboardInterrupt("killed")
        return evaluate(parts, source, cfg, step, ranks, **kw)

    monkeypatch.setattr(recsz.train, "evaluate", dies_at_the_end)
    run, on = tmp_path / "run", ["--device", device]
    with pytest.raises(KeyboardInterrupt):
        main([*BASE, *on, "--out", str(run)])
    assert [d.name for d in checkpoint.complete(run)][-1] == "step-000000004"
    monkeypatch.setattr(recsz.train, "evaluate", evaluate)
    again, straight = train(run, *on), train(tmp_path / "straight", *on)
    for k in ("auc", "logloss", "steps", "bytes_raw"):
        assert again[k] == pytest.approx(straight[k], rel=1e-9), k
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]  # no step trained twice


def test_every_checkpoint_is_complete_before_an_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint written steps before an evaluation, its rows logged rarely, is complete
    when the evaluation starts (it was completed at the next logged row): a job killed
    during that evaluation goes on from it, not from the one before."""
    import recsz.train

    evaluate, seen = recsz.train.evaluate, dict[int, list[str]]()

    def evaluated(parts, source, cfg, step, ranks, **kw):  # type: ignore[no-untyped-def]
        seen[step] = [d.name[-1] for d in checkpoint.complete(Path(cfg.out))]
        return evaluate(parts, source, cfg, step, ranks, **kw)

    monkeypatch.setattr(recsz.train, "evaluate", evaluated)
    train(tmp_path / "run", "--steps", "6", "--eval-every", "3", "--log-every", "100")
    assert seen == {3: ["2"], 6: ["2", "4", "6"]}


@pytest.mark.parametrize("device", DEVICES)
def test_sigterm_during_an_evaluation_ends_it_and_saves_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], device: str
) -> None:
    """SIGTERM during an evaluation of a step without a checkpoint (mid-run; the final one
    of a run without --checkpoint-every): the evaluation ends after its batch under way, the
    run saves that step and exits with 143, that step's training row logged; the same
    command line again evaluates the step first and ends as the run never stopped, each
    evaluation's row and each step's once."""
    import os
    import signal

    import recsz.train

    evaluate, heard_at = recsz.train.evaluate, list[int]()

    def signalled_in(at: int):  # type: ignore[no-untyped-def]
        def evaluated(parts, source, cfg, step, ranks, heard):  # type: ignore[no-untyped-def]
            def asked() -> bool:
                heard_at.append(step)
                if step == at and heard_at.count(at) == 1:  # after its first batch
                    os.kill(os.getpid(), signal.SIGTERM)
                return heard()

            return evaluate(parts, source, cfg, step, ranks, heard=asked)

        return evaluated

    def rows(run: Path, key: str) -> list[int]:
        got = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in got if key in r]

    on = ["--device", device, "--steps", "6", "--eval-every", "2", "--eval-batch-size", "64"]
    for every, at in (("3", 4), ("0", 6)):  # mid-run; the final evaluation
        flags = [*on, "--checkpoint-every", every]
        straight = train(tmp_path / f"straight-{every}", *flags)
        run = tmp_path / f"run-{every}"
        monkeypatch.setattr(recsz.train, "evaluate", signalled_in(at))
        heard_at.clear()
        assert main([*BASE, *flags, "--out", str(run)]) == 143
        assert heard_at.count(at) == 1  # of its 4 batches (256 samples)
        said = capsys.readouterr().out
        assert f"stopped at step {at} (SIGTERM) during its evaluation, left unfinished" in said
        assert checkpoint.complete(run)[-1].name == f"step-{at:09d}"
        assert rows(run, "loss") == list(range(1, at + 1))
        assert rows(run, "eval_auc") == [s for s in (2, 4) if s < at]
        assert not (run / "summary.json").exists()
        monkeypatch.setattr(recsz.train, "evaluate", evaluate)
        again = train(run, *flags)
        first = "did not end before the run stopped" if at < 6 else "its final evaluation cut"
        assert first in capsys.readouterr().out
        for k in ("auc", "logloss", "steps", "bytes_raw"):
            assert again[k] == pytest.approx(straight[k], rel=1e-9), k
        assert rows(run, "loss") == list(range(1, 7)) and rows(run, "eval_auc") == [2, 4, 6]


def test_truncated_and_empty_files_are_refused(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    for size in (0, 1000):
        dst = tmp_path / f"cut-{size}"
        shutil.copytree(run_dir, dst)
        f = checkpoint.complete(dst)[-1] / "rank-0.pt"
        f.write_bytes(f.read_bytes()[:size])
        with pytest.raises(ValueError, match=r"rank-0\.pt: checksum mismatch"):
            main([*BASE, "--steps", "6", "--resume", str(dst)])


def test_old_checkpoints_are_pruned(tmp_path: Path) -> None:
    train(tmp_path, "--steps", "10", "--keep-checkpoints", "2")
    kept = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert sorted(kept) == ["step-000000008", "step-000000010"]


def test_a_full_disk_is_named_and_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint that does not fit its filesystem is said so, with its free room, whether
    the write raises ENOSPC, fails as torch's writer does on a full disk ("unexpected pos",
    no errno: told by the room left), or is refused before it starts (less room than its
    tensors' bytes); bad input (the launcher does not start the job again), no temporary
    file and no incomplete checkpoint left. A failure with room to spare is itself."""
    from collections import namedtuple

    from recsz import checkpointwrite
    from recsz.ranks import bad_input

    usage, saved = namedtuple("usage", "total used free"), torch.save
    room = {"free": 10**12}
    monkeypatch.setattr(checkpointwrite.shutil, "disk_usage",
                        lambda p: usage(10**12, 0, room["free"]))  # fmt: skip

    def failing(error: BaseException, free_after: int):
        def save(obj: object, f: object) -> None:
            Path(str(f)).write_bytes(b"partial")
            room["free"] = free_after
            raise error

        return save

    cases = [
        (failing(OSError(28, "No space left on device"), 10**12), "no space left on device"),
        (failing(RuntimeError("[enforce fail] unexpected pos 3968 vs 3862"), 100), "no space"),
        (saved, r"no room for its \d+\.\d MB \(0\.0 MB free on its filesystem\)"),
    ]
    for i, (save, said) in enumerate(cases):
        room["free"] = 10**12 if save is not saved else 1000
        monkeypatch.setattr(torch, "save", save)
        out = tmp_path / str(i)
        file = rf"{out}/checkpoints/step-000000002/rank-0\.pt"
        with pytest.raises(OSError, match=rf"step 2: rank 0: cannot write {file}: {said}") as e:
            main([*BASE, "--out", str(out)])
        assert bad_input(e.value), i
        assert (
            not list(out.rglob("*.tmp")) and not (out / "checkpoints" / "step-000000002").exists()
        )
    room["free"] = 10**12  # room to spare: torch's error as it is, not bad input
    monkeypatch.setattr(torch, "save", failing(RuntimeError("unexpected pos 3 vs 2"), 10**12))
    with pytest.raises(OSError, match=r"rank 0: RuntimeError: unexpected pos 3 vs 2") as e:
        main([*BASE, "--out", str(tmp_path / "room")])
    assert not bad_input(e.value)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_the_metrics_log_is_named(tmp_path: Path) -> None:
    """A metrics row that finds its filesystem full names the log (a write's error names
    no file: it said only "[Errno 28] No space left on device")."""
    from recsz import report

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # (every write: ENOSPC)
    log = report.Log(tmp_path)
    with pytest.raises(OSError, match=r"cannot write .*metrics\.jsonl: no space left on dev"):
        log.metrics({"step": 1})


def test_resume_bookkeeping(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    # A finished run resumed: nothing happens, summary.json stays as it was.
    before = (run_dir / "summary.json").read_text()
    assert main([*BASE, "--resume", str(run_dir)]) == 0
    assert (run_dir / "summary.json").read_text() == before
    # Fewer steps than the checkpoint: refused.
    with pytest.raises(ValueError, match="--steps 3 is below the step of the checkpoint"):
        main([*BASE, "--steps", "3", "--resume", str(run_dir)])
    # Resumed to 6 steps: the summary counts all 6 steps' bytes, as a straight run does.
    dst = tmp_path / "resumed"
    shutil.copytree(run_dir, dst)
    resumed = train(dst, "--steps", "6", "--resume", str(dst))
    straight = train(tmp_path / "straight", "--steps", "6")
    for k in ("bytes_raw", "bytes_payload", "fwd_ratio", "bwd_ratio", "auc"):
        assert resumed[k] == pytest.approx(straight[k], rel=1e-6), k
    # What does not change the run from a checkpoint on may differ; what does may not.
    shutil.copytree(run_dir, tmp_path / "other")
    more = ("--steps", "6", "--resume", str(tmp_path / "other"))
    again = train(tmp_path / "other", *more, "--mlp-init", "torch", "--host-memory", "return")
    assert again["auc"] == pytest.approx(straight["auc"], rel=1e-6)
    with pytest.raises(ValueError, match=r"another configuration \(emb_lr: None -> 0.2\)\Z"):
        main([*BASE, *more, "--emb-lr", "0.2"])  # no hint of --resume-fallback: it would not do
    with pytest.raises(ValueError, match=r"step-0+6 was written with another configuration"):
        main([*BASE, *more, "--emb-lr", "0.2", "--resume-fallback"])  # the newest named


def test_resume_from_a_named_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    """--resume RUN/checkpoints/step-N continues from that one (not the newest), writing
    into RUN; a damaged one named so is an error even with --resume-fallback."""
    import shutil

    dst = tmp_path / "named"
    shutil.copytree(run_dir, dst)
    older = checkpoint.complete(dst)[0]
    assert older.name == "step-000000002"
    assert main([*BASE, "--steps", "6", "--resume", str(older)]) == 0
    resumed = json.loads((dst / "summary.json").read_text())
    straight = train(tmp_path / "straight", "--steps", "6")

    def steps(run: Path) -> list[int]:
        return [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]

    assert steps(dst) == steps(tmp_path / "straight")  # rows after step 2 written again
    for k in ("bytes_payload", "fwd_ratio", "auc"):
        assert resumed[k] == pytest.approx(straight[k], rel=1e-6), k
    f = older / "rank-0.pt"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"step-000000002/rank-0\.pt: checksum mismatch"):
        main([*BASE, "--steps", "6", "--resume", str(older), "--resume-fallback"])


def test_a_resumed_run_takes_the_flags_it_is_not_given(tmp_path: Path) -> None:
    """`--resume RUN --steps N` alone: the run's configuration (not the defaults), but
    its run directory where it now is (moved since) and no test's injected failure."""
    import shutil

    flags = ("--fwd-codec", "hybrid", "--emb-lr", "0.2")
    train(tmp_path / "src", *flags, "--inject-failure", "0:5")  # 4 steps: never reached
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "src", moved)
    assert main(["--resume", str(moved), "--steps", "6"]) == 0
    resumed = json.loads((moved / "summary.json").read_text())
    straight = train(tmp_path / "straight", *flags, "--steps", "6")
    assert resumed["config"]["fwd_codec"] == "hybrid" and resumed["steps"] == 6
    for k in ("bytes_raw", "bytes_payload", "fwd_ratio", "auc"):
        assert resumed[k] == pytest.approx(straight[k], rel=1e-6), k
    assert not (tmp_path / "src").exists()
    with pytest.raises(ValueError, match=r"another configuration \(fwd_codec: 'hybrid' -> 'none'"):
        main(["--resume", str(moved), "--steps", "8", "--fwd-codec", "none"])


def test_a_run_without_checkpoints_says_why_it_has_no_model(tmp_path: Path) -> None:
    """Trained without --checkpoint-every: resume, evaluate and export name the flag that
    keeps a model, not only the missing directory."""
    from recsz import evaluation

    out = tmp_path / "plain"
    train(out, "--checkpoint-every", "0")
    why = "trained without --checkpoint-every, so it kept no model"
    with pytest.raises(FileNotFoundError, match=f"--resume {out}.*{why}"):
        main([*BASE, "--resume", str(out)])
    with pytest.raises(FileNotFoundError, match=why):
        evaluation.chosen(out)
    (tmp_path / "other").mkdir()  # not a run at all: the directory it lacks
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint \(RUN/checkpoints"):
        evaluation.chosen(tmp_path / "other")


def test_checkpoints_are_written_while_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU (taken here by the CPU) each rank's file is written from a snapshot by a
    thread (made slow here: training takes steps meanwhile, changing every tensor the file
    holds) and completed at the next logged step: resuming from it ends where the straight
    run does. A crash before the completion loses that checkpoint, and the run resumes from
    the one before. Where the host's free memory would not hold the snapshot, or on the CPU,
    the live state is written at once."""
    import time

    from recsz import checkpointwrite, hostmemory

    run_of = checkpointwrite._Write.run
    threads: list[str] = []

    def slow(self: object, state: dict) -> None:
        threads.append(__import__("threading").current_thread().name)
        time.sleep(0.3)
        run_of(self, state)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpointwrite._Write, "run", slow)
    monkeypatch.setattr(hostmemory, "available", lambda: 1 << 40)
    cpu_s = checkpointwrite.in_background
    assert not cpu_s(torch.device("cpu")) and cpu_s(torch.device("cuda", 0))
    monkeypatch.setattr(checkpointwrite, "in_background", lambda device: True)
    flags = ["--steps", "8", "--log-every", "4"]
    straight = train(tmp_path / "straight", *flags)
    assert threads == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    kept = [d.name for d in checkpoint.complete(tmp_path / "straight")]
    assert kept == ["step-000000004", "step-000000006", "step-000000008"]  # keep 3
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="injected failure"):
        train(crashed, *flags, "--inject-failure", "0:5")
    # step 2's completed at step 4's row; step 4's would have been at step 8's
    assert [d.name for d in checkpoint.complete(crashed)] == ["step-000000002"]
    assert not list(crashed.rglob("*.tmp"))
    resumed = train(crashed, *flags, "--resume", str(crashed))
    for k in ("auc", "logloss", "bytes_payload"):
        assert resumed[k] == pytest.approx(straight[k], rel=1e-6), k
    threads.clear()
    monkeypatch.setattr(hostmemory, "available", lambda: 1000)
    train(tmp_path / "tight", *flags)
    assert threads == ["MainThread"] * 4
    assert len(checkpoint.complete(tmp_path / "tight")) == 3
    threads.clear()
    monkeypatch.setattr(hostmemory, "available", lambda: 1 << 40)
    monkeypatch.setattr(checkpointwrite, "in_background", cpu_s)
    train(tmp_path / "cpu", *flags)
    assert threads == ["MainThread"] * 4


def test_a_snapshot_copies_every_tensor_onto_its_device() -> None:
    """What a checkpoint's load keeps as read (the MLP hook's residuals, the optimizers'
    state, the counters) is placed on the rank's device as copies, in dicts, lists and
    tuples at any depth (here the meta device stands in for a GPU): nothing shares the
    file's memory-mapped pages, nothing stays on the host beside a GPU's model."""
    x = torch.arange(6.0)
    state = {"eb": {"residual": {0: x, 1: [x, (x[:2], 3)]}}, "n": 4, "name": "a"}
    moved = checkpoint.snapshot(state, torch.device("meta"))
    assert moved["eb"]["residual"][0].device.type == "meta"
    assert moved["eb"]["residual"][1][1][0].shape == (2,)
    assert moved["eb"]["residual"][1][1][1] == 3 and moved["n"] == 4 and moved["name"] == "a"
    here = checkpoint.snapshot(state)
    here["eb"]["residual"][0][0] = 100.0  # a copy: the original is untouched
    assert x[0] == 0 and here["eb"]["residual"][0].data_ptr() != x.data_ptr()


def test_a_run_of_the_configuration_version_before_goes_on_after_an_upgrade(
    tmp_path: Path,
) -> None:
    """A run written by a recsz before (configuration version 17: no --emb-dim,
    --bottom-mlp, --top-mlp, --max-rows (18) nor --table-rows, --dense-features (19), which
    keep its model at their defaults) goes on
    from its checkpoint, by the same command line or --resume, and ends as a straight run;
    `recsz evaluate` scores it (the configuration then carries its record's version);
    given a shape it cannot have held, it is another run. A record of a version whose
    fields changed meaning (16) stays another run's."""
    import hashlib

    def aged(run: Path, version: int) -> None:
        """The run's records as the recsz of ``version`` wrote them: its fields then, its
        fingerprint of them, its records' checksums."""
        added = [k for v in range(version + 1, CONFIG_VERSION + 1)
                 for k in checkpoint.ADDED.get(v, ())]  # fmt: skip

        def old(cfg: dict) -> dict:
            return {**{k: v for k, v in cfg.items() if k not in [*added, "profile"]},
                    "config_version": version}  # fmt: skip

        (run / "config.json").write_text(json.dumps(old(json.loads((run / "config.json")
                                                              .read_text()))))  # fmt: skip
        for meta_path in run.glob("checkpoints/*/meta.json"):
            meta = json.loads(meta_path.read_text())
            meta["config"] = old(meta["config"])
            kept = {k: v for k, v in meta["config"].items() if k not in checkpoint.MAY_CHANGE}
            meta["fingerprint"] = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()
                                                 ).hexdigest()[:16]  # fmt: skip
            meta["checksum"] = checkpoint.record_digest(meta)
            meta_path.write_text(json.dumps(meta))

    run = tmp_path / "run"
    train(run)  # 4 steps, checkpoints at 2 and 4
    aged(run, 17)
    assert main([*BASE, "--steps", "6", "--out", str(run)]) == 0  # the same command line
    assert json.loads((run / "config.json").read_text())["config_version"] == CONFIG_VERSION
    straight = train(tmp_path / "straight", "--steps", "6")
    resumed = json.loads((run / "summary.json").read_text())
    for key in ("steps", "auc", "logloss", "bytes_sent"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6), key
    other = tmp_path / "other"
    train(other)
    aged(other, 17)
    from recsz.cli import main as cli_main

    assert cli_main(["evaluate", str(other)]) == 0  # (its record's version is the config's)
    with pytest.raises(ValueError, match=r"written with another configuration \(emb_dim: None "
                       r"-> 8\)"):  # fmt: skip
        main(["--resume", str(other), "--steps", "6", "--emb-dim", "8", "--no-progress"])
    assert main(["--resume", str(other), "--steps", "6", "--no-progress"]) == 0
    older = tmp_path / "older"
    train(older)
    aged(older, 16)
    with pytest.raises(
        ValueError, match=rf"holds another run .*config_version: 16 -> {CONFIG_VERSION}"
    ):
        main([*BASE, "--steps", "6", "--out", str(older)])
