"""Launching a job's ranks: ``recsz train --nproc N`` (:func:`launch`: torchrun's agent an
attempt, restarts, bad input named once) and ``python -m recsz.launcher``, torchrun's agent
with recsz's report of a failure (:func:`_report`) in torchrun's place (a node of a
multi-node job). The ranks' side (how a rank fails, :func:`recsz.ranks.worker`) is
:mod:`recsz.ranks`'."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recsz.ranks import AGENT, ATTEMPT, BAD_INPUT, FAILURES
from recsz.stopping import SIGNALS, heeded


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
    cmd = [sys.executable, "-m", "recsz.launcher", "--standalone",
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
            if note := noted(failures):
                again = (", the job not started again (it would fail the same way)"
                         if max_restarts else "")  # fmt: skip
                kinds, said = note
                print(f"recsz: {kinds}{again}: {said}", file=sys.stderr, flush=True)
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


def noted(failures: Path) -> tuple[str, str] | None:
    """What the ranks noted in ``failures``: its kinds (``bad input``, ``out of memory``,
    ``no room on disk``: :func:`recsz.ranks.failure_kind`), and each message once with the
    ranks that said it; None where no rank noted any."""
    by: dict[tuple[str, str], list[int]] = {}
    for f in sorted(failures.glob("rank-*"), key=lambda f: int(f.name[5:])):
        kind, _, message = f.read_text().partition("\n")
        by.setdefault((kind, message), []).append(int(f.name[5:]))
    if not by:
        return None
    kinds = list(dict.fromkeys(kind for kind, _ in by))
    return " and ".join(filter(None, [", ".join(kinds[:-1]), kinds[-1]])), "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for (_, m), r in by.items()
    )


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


def _not_reported(record: logging.LogRecord) -> bool:
    """A logging filter for torchrun's agent as :func:`_agent` runs it: not its lines of a
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


#: What a collective's error says where a peer's connection went (gloo's, NCCL's): the
#: failure is the peer's.
_LOST_PEER = ("closed by peer", "reset by peer", "remote process exited", "Broken pipe")


def _report(failures: dict[int, Any], forced: set[int] | frozenset[int] = frozenset()) -> str:
    """The failed ranks of a job that :func:`_agent` ran (``failures``: torchrun's
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
        lost = not rest and any(p in trace.rstrip().rsplit("\n", 1)[-1] for p in _LOST_PEER)
        rest.append(f"recsz: rank {rank} failed first; its traceback:\n{trace.rstrip()}")
        if lost:  # (and nothing else here failed)
            rest.append(f"recsz: rank {rank} lost a peer, and no rank of this node failed "
                        "before it: on a job of several nodes, the cause is in another "
                        "node's log")  # fmt: skip
    lines = killed or rest + stuck  # (killed: the others failed for want of it)
    return "\n".join(lines or [f"recsz: ranks {sorted(failures)} stopped"])


def _no_restart_on_bad_input() -> None:
    """torchrun's agent, as :func:`_agent` runs it, does not start its ranks again (its own
    ``--max-restarts``) after a rank's bad input: the same input fails the same way. (Its
    loop restarts while restarts remain, read after each look at the ranks, which sets
    them to none then; where a later torch names them otherwise, it restarts as torchrun
    does.)"""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    look = LocalElasticAgent._monitor_workers

    def looked(self: Any, group: Any) -> Any:
        result = look(self, group)
        if any(f.exitcode == BAD_INPUT for f in getattr(result, "failures", {}).values()):
            self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = looked  # type: ignore[method-assign]


def _agent(args: list[str]) -> int:
    """torchrun's agent (``torch.distributed.run``) with torchrun's flags ``args``, as
    :func:`launch` runs it and as ``python -m recsz.launcher`` runs it in torchrun's place (a
    node of a multi-node job): a failure said by :func:`_report`, quiet where a rank failed
    on bad input, which that rank has said, and where a signal passed on stopped the job
    (torchrun's report, with a traceback of the agent's own, would bury what the ranks
    said)."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, error_handler
    from torch.distributed.run import main

    if not os.environ.get("RECSZ_TRACEBACK"):  # (else torchrun's report, all of it)
        for logger in (api.logger, error_handler.logger, agent_api.logger):
            logger.addFilter(_not_reported)
        os.environ[AGENT] = "1"  # (the ranks keep their tracebacks for _report)
    _no_restart_on_bad_input()
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
