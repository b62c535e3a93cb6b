"""The job's processes: who this rank is, the process group, and launching local ranks."""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recsz.stopping import SIGNALS, heeded

#: torchrun's switch off of its store shared by rendezvous rounds, whose keys a restarted
#: job's ranks read as their own (pytorch/pytorch#135712: they then fail to connect).
SEPARATE_STORES = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass
class Ranks:
    """Who we are in the job. ``world == 1`` runs without any process group."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def from_env(cls, timeout_s: float, device: str = "cpu") -> Ranks:
        """One process group for the job. On CPU, gloo; with CUDA, gloo for the small CPU
        tensors (sizes) and NCCL for the CUDA ones (payloads, MLP gradients): NCCL moves
        CUDA tensors only, and picking it alone failed every CPU collective."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dev = torch.device("cpu")
        if device == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        if world == 1:
            return cls(device=dev)
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
        kw: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
        except RuntimeError as e:
            again = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            if again and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                raise RuntimeError(
                    f"{e}: a job torchrun restarted, its ranks meeting in the store of the "
                    f"attempt before: launch it with {SEPARATE_STORES}=1 (pytorch/pytorch#135712; "
                    "`recsz train --max-restarts` starts a fresh agent instead)"
                ) from e
            raise
        return cls(dist.get_rank(), dist.get_world_size(), dev)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self, ok: bool) -> None:
        """Leave the group; on success wait for everyone first, so that no rank tears
        down its connections while a peer is still using them (gloo aborts then)."""
        if self.world > 1 and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()

    def check_same(self, config: dict[str, Any]) -> None:
        """Refuse to start when ranks were launched with different configurations."""
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
        fps = self.gather(digest)
        bad = [r for r, f in enumerate(fps) if f != fps[0]]
        if bad:
            raise ValueError(
                f"ranks {bad} were started with a configuration that differs from "
                f"rank 0's ({fps[0]} vs {[fps[r] for r in bad]})"
            )


#: A launched rank's exit status on bad input, as `recsz`'s own (``recsz.cli``): the
#: launcher does not start such a job again, which the same input would fail again.
BAD_INPUT = 2
#: The launcher's folder where its ranks note their bad input (one file a rank), and the
#: attempt its ranks belong to (0: the first; :func:`launch` restarts a failed job).
FAILURES, ATTEMPT = "RECSZ_FAILURES", "RECSZ_ATTEMPT"


#: What a rank raises on bad input (:func:`bad_input`).
_BAD_INPUT = (ValueError, FloatingPointError, FileNotFoundError, NotADirectoryError,
              IsADirectoryError, PermissionError, ImportError)  # fmt: skip


def bad_input(e: BaseException) -> bool:
    """Whether ``e`` says that the job's input is bad (a ``ValueError``: a data line, a flag,
    a checkpoint, a run another job writes; a ``FloatingPointError``: settings under which
    the loss diverged; a path that is missing, of the wrong kind or not permitted; an
    ``ImportError``: a library the options need is not installed), which
    the same command line would raise again; not bytes damaged on their way from a peer (a
    ``PayloadError`` anywhere in its chain), which need not be damaged again, nor other
    ``OSError``s (a network file system's hiccup)."""
    from recsz.codecs.payload import PayloadError

    if not isinstance(e, _BAD_INPUT):
        return False
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, PayloadError):
            return False
        seen = seen.__cause__ or seen.__context__
    return True


def restarted() -> bool:
    """Whether this rank's job was started again after a failure (by :func:`launch`, or by
    a plain torchrun's agent)."""
    return any(int(os.environ.get(k, "0")) for k in (ATTEMPT, "TORCHELASTIC_RESTART_COUNT"))


def worker(body: Callable[[], int], as_main: bool) -> int:
    """Run a rank's ``body`` (``recsz train``'s, ``recsz evaluate``'s) and return its exit
    status: under torchrun's agent, stop with it (:func:`watch_parent`); a launched rank's
    failure names the rank, and on bad input (:func:`bad_input`) ends it with
    :data:`BAD_INPUT`, the message without a traceback (``RECSZ_TRACEBACK=1`` shows it), as
    `recsz` says a lone process's.
    ``as_main``: the process is this rank's alone (``python -m``), and leaves without C++
    static destructors once the job is done."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun's agent
        watch_parent()
    if as_main:  # (a rank's process: its warnings said as recsz's lines are)
        from recsz.report import plain_warnings

        plain_warnings()
    rank = os.environ.get("RANK", "0")
    try:
        status = body()
    except KeyboardInterrupt:  # SIGINT where no run directory asks for a checkpoint, or a
        if "WORLD_SIZE" not in os.environ:  # second Ctrl-C (recsz.stopping)
            raise
        if rank == "0":
            print("recsz: interrupted (SIGINT)", file=sys.stderr, flush=True)
        status = 128 + signal.SIGINT
    except Exception as e:
        if "WORLD_SIZE" not in os.environ:  # alone: the command says it once
            raise
        status = _failed(e, rank)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and as_main:
        # A worker whose job is done and whose group is destroyed leaves without running
        # C++ static destructors: under load, gloo's teardown occasionally aborted there
        # ("terminate called without an active exception") after all work had succeeded.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _failed(e: Exception, rank: str) -> int:
    """A launched rank's failure ``e`` said in a line, and its exit status: on bad input
    :data:`BAD_INPUT` (:func:`launch` names it, for all ranks), else 1, its traceback kept
    for :func:`launch`'s agent to show (:func:`_report`). Raised, for its traceback on
    stderr, where ``RECSZ_TRACEBACK`` asks for it and under a plain torchrun's agent (whose
    report shows it). Called while ``e`` is handled."""
    said = f"{type(e).__name__}: {e}"
    folder, bad = os.environ.get(FAILURES), bad_input(e)
    if not (folder and bad):
        print(f"recsz: rank {rank} failed: {said}", file=sys.stderr, flush=True)
    if os.environ.get("RECSZ_TRACEBACK") or not (bad or folder):
        raise e
    if not bad:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)  # the file torchrun's agent reads
        return 1
    if folder:
        Path(folder).mkdir(mode=0o700, exist_ok=True)
        (Path(folder) / f"rank-{rank}").write_text(said)
    return BAD_INPUT


def launch(nproc: int, argv: list[str], module: str = "recsz.train", max_restarts: int = 0) -> int:
    """Run ``module`` (``recsz.train``, ``recsz.evaluation``) on ``nproc`` local ranks
    under torchrun and return its exit status; its agent stops all of them on any failure.
    A job that failed is started again, up to ``max_restarts`` times (a fresh agent each
    time), unless a rank said its input is bad (:data:`BAD_INPUT`): then the launcher names
    the problem once, last, and returns that status."""
    # Workers learn their count from torchrun's env (torchrun would also misread "--nproc"
    # as an abbreviation of its own flag): "--nproc N" and "--nproc=N" are left out.
    at = [i for i, a in enumerate(argv) if a == "--nproc"]
    drop = {*at, *(i + 1 for i in at)}
    worker_argv = [a for i, a in enumerate(argv) if i not in drop and not a.startswith("--nproc=")]
    cmd = [sys.executable, "-m", "recsz.ranks", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", module, *worker_argv]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # The agent dies with this process (even a SIGKILL of it), and a SIGTERM or SIGINT
    # sent here is passed on: torchrun's agent then stops its workers, and the workers
    # stop by themselves when their agent is gone (watch_parent). The agent has a session
    # of its own, so a terminal's Ctrl-C reaches its workers once, passed on, not also
    # straight from the terminal.
    previous = {sig: signal.getsignal(sig) for sig in heeded()}
    forwarded: list[int] = []
    agent: subprocess.Popen | None = None

    def forward(sig: int, _frame: object) -> None:
        forwarded.append(sig)
        if agent is not None:
            agent.send_signal(sig)

    for sig in previous:
        signal.signal(sig, forward)
    # made by a rank only where one notes bad input (a launcher killed outright leaves none)
    failures = Path(tempfile.gettempdir()) / f"recsz-failures-{os.getpid()}-{time.time_ns()}"
    env[FAILURES] = str(failures)
    try:
        for attempt in range(max_restarts + 1):
            if forwarded:  # asked to stop between two attempts
                return 128 + forwarded[0]
            env[ATTEMPT] = str(attempt)
            # (held while it starts: one that comes meanwhile is passed on once, after)
            signal.pthread_sigmask(signal.SIG_BLOCK, previous)
            try:
                agent = subprocess.Popen(
                    cmd, env=env, preexec_fn=_agent_setup, start_new_session=True
                )
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, previous)
            status = agent.wait()
            # Stopped by a signal passed on (the ranks saved a checkpoint on SIGTERM): a
            # shell's status of a process the signal ended, not the agent's 1.
            if not status or forwarded:
                return 128 + forwarded[0] if status and forwarded else status
            if said := _bad_input_said(failures):
                again = (", the job not started again (it would fail the same way)"
                         if max_restarts else "")  # fmt: skip
                print(f"recsz: bad input{again}: {said}", file=sys.stderr, flush=True)
                return BAD_INPUT
            if attempt < max_restarts:
                print(f"recsz: the job failed (exit status {status}): starting its "
                      f"ranks again ({attempt + 1} of {max_restarts} restarts)",
                      file=sys.stderr, flush=True)  # fmt: skip
        return status
    finally:
        shutil.rmtree(failures, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _bad_input_said(failures: Path) -> str:
    """What the ranks noted in ``failures``, each message once with the ranks that said it."""
    by: dict[str, list[int]] = {}
    for f in sorted(failures.glob("rank-*"), key=lambda f: int(f.name[5:])):
        by.setdefault(f.read_text(), []).append(int(f.name[5:]))
    return "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in by.items()
    )


#: glibc's mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(mmap_from: int = 32 << 20, trim_from: int = 1 << 30) -> bool:
    """Let glibc's malloc keep for the next step what a step frees. By default it maps
    every block from 128 KiB afresh (the bound grows only as such blocks are freed) and
    gives the heap's free top back above twice that, so a step that frees several large
    tensors faults their pages in again in the next (2 ranks: 1-23% samples/s,
    benchmarks/README.md). Here blocks under ``mmap_from`` (32 MiB, glibc's largest)
    come from the heap, which is trimmed only when ``trim_from`` lies free on top. True
    where both settings took (glibc); elsewhere nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_from) and mallopt(_M_TRIM_THRESHOLD, trim_from))


def _agent_setup() -> None:
    """In the agent before exec: the signals :func:`launch` held while starting it taken
    again, and :func:`_die_with_parent`."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    _die_with_parent()


def _die_with_parent() -> None:
    """In a child before exec (Linux): SIGTERM it when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: watch_parent in the workers still acts
        pass


def watch_parent(interval_s: float = 0.5) -> None:
    """Stop this process when its parent (torchrun's agent) is gone, e.g. killed with
    SIGKILL: a daemon thread notices that the process was re-parented and ends it, so no
    rank trains on unsupervised. Call once, early, in a worker."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                print(
                    f"recsz: rank {os.environ.get('RANK', '?')}: launcher (pid {parent}) "
                    "is gone; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="recsz-watch-parent", daemon=True).start()


def _not_reported(record: logging.LogRecord) -> bool:
    """A logging filter for torchrun's agent as :func:`launch` runs it: not its lines of a
    failed rank's exit code and of the others closed, which :func:`_report` says, nor of a
    signal passed on."""
    said = record.msg if isinstance(record.msg, str) else ""
    if said.startswith("Unable to shutdown process %s via") and record.args:
        _forced.add(int(record.args[0]))  # type: ignore[index, call-overload]
        return False
    return not said.startswith(
        (
            "failed (exitcode:",
            "Sending process %s closing signal",
            "no error file defined for parent",
            "Received %s death signal",  # (passed on by launch(): the ranks say where they stop)
        )
    )


#: How the ranks that torchrun's agent closes when one fails end (killed by its signal, or
#: stopped on it: recsz.stopping).
_CLOSED = (-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT)
#: The pids torchrun's agent killed (SIGKILL) when they did not heed its closing signal
#: (:func:`_not_reported` reads its log).
_forced: set[int] = set()


def _report(failures: dict[int, Any], forced: set[int] | frozenset[int] = frozenset()) -> str:
    """The failed ranks of a job that :func:`launch`'s agent ran (``failures``: torchrun's
    ``ProcessFailure``s by rank), in place of torchrun's report: a rank a signal killed
    (SIGKILL: the out-of-memory killer's) named as the cause, the others' lost peers not
    shown; else the traceback of the rank that failed first (each rank said its line as it
    failed; ``RECSZ_TRACEBACK=1`` shows every traceback); the ranks the agent closed left
    out, but for those it killed (``forced``: their pids) when they did not stop."""
    killed, rest, stuck, first = [], [], [], None
    for rank, f in sorted(failures.items()):
        if f.exitcode in _CLOSED:
            continue
        if f.exitcode < 0 and f.pid in forced:
            stuck.append(f"recsz: rank {rank} (pid {f.pid}) did not stop when the job's ranks "
                         "were closed, and was killed (stuck in a call?)")  # fmt: skip
        elif f.exitcode < 0:
            hint = (" (the kernel's out-of-memory killer sends it: see `dmesg`)"
                    if f.exitcode == -signal.SIGKILL else "")  # fmt: skip
            killed.append(f"recsz: rank {rank} (pid {f.pid}) was killed by {f.signal_name()}{hint}")
        elif not os.path.isfile(f.error_file):  # (a rank's recorded exception: _failed)
            rest.append(f"recsz: rank {rank} (pid {f.pid}) exited with status {f.exitcode}")
        elif first is None or os.stat(f.error_file).st_mtime_ns < first[0]:
            first = (os.stat(f.error_file).st_mtime_ns, rank, f.error_file_data)
    if first is not None:
        _, rank, data = first
        said = data.get("message", "")  # (ErrorHandler's record, or a plain message)
        trace = (
            said.get("extraInfo", {}).get("py_callstack", "") if isinstance(said, dict) else said
        )
        rest.append(f"recsz: rank {rank} failed first; its traceback:\n{trace.rstrip()}")
    lines = killed or rest + stuck  # (killed: the others failed for want of it)
    return "\n".join(lines or [f"recsz: ranks {sorted(failures)} stopped"])


def _agent(args: list[str]) -> int:
    """torchrun's agent (``torch.distributed.run``) with the flags ``args``, as
    :func:`launch` runs it: quiet where a rank failed on bad input, which that rank has said,
    and where a signal passed on stopped the job (torchrun's report, with a traceback of the
    agent's own, would bury what the ranks said)."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, error_handler
    from torch.distributed.run import main

    if not os.environ.get("RECSZ_TRACEBACK"):  # (else torchrun's report, all of it)
        for logger in (api.logger, error_handler.logger, agent_api.logger):
            logger.addFilter(_not_reported)
    try:
        main(args)
    except ChildFailedError as e:
        if any(f.exitcode == BAD_INPUT for f in e.failures.values()):
            return BAD_INPUT
        if os.environ.get("RECSZ_TRACEBACK"):
            raise
        print(_report(e.failures, _forced), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(_agent(sys.argv[1:]))
