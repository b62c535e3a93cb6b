"""A rank of the job: who it is, its process group, how it fails (:func:`worker`); its
process's malloc. Launching ranks: :mod:`recsz.launcher`."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recsz.diskroom import NO_ROOM
from recsz.stopping import heeded

#: torchrun's switch off of its store shared by rendezvous rounds, whose keys a restarted
#: job's ranks read as their own (pytorch/pytorch#135712: they then fail to connect).
SEPARATE_STORES = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: where torchrun's agent has a rank record its exception (its ``ErrorHandler`` reads it)
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


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
#: attempt its ranks belong to (0: the first; :func:`recsz.launcher.launch` restarts a
#: failed job).
FAILURES, ATTEMPT = "RECSZ_FAILURES", "RECSZ_ATTEMPT"
#: Set for the ranks of recsz's torchrun agent (``python -m recsz.launcher``), which
#: reports their failures (:func:`recsz.launcher._report`).
AGENT = "RECSZ_AGENT"


#: What a rank raises on bad input (:func:`bad_input`).
_BAD_INPUT = (ValueError, FloatingPointError, FileNotFoundError, NotADirectoryError,
              IsADirectoryError, PermissionError, ImportError)  # fmt: skip


#: What a run out of the GPU's memory may change (said after torch's message).
OOM_HINT = ("recsz: a smaller --batch-size or --eval-batch-size, --table-dtype fp16, more "
            "ranks or --column-shards; `recsz plan` says what each rank holds")  # fmt: skip


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says that memory ran out: the GPU's (``torch.OutOfMemoryError``), the
    host's (``MemoryError``, or torch's CPU allocator's RuntimeError)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


#: What a collective that timed out means (said after gloo's "Timed out waiting 20000ms for
#: send operation to complete", which names neither the option nor the peer's part).
TIMEOUT_HINT = ("recsz: no peer answered within --dist-timeout: one is stuck, stopped or far "
                "slower; raise --dist-timeout if a rank's own work takes that long")  # fmt: skip
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms|ran for \d+ milliseconds before timing out")


def said(e: BaseException) -> str:
    """``e``'s message, with :data:`OOM_HINT` after torch's out-of-memory errors (recsz's
    own MemoryErrors say what to change) and :data:`TIMEOUT_HINT` after a collective's
    timeout (gloo's, NCCL's)."""
    if out_of_memory(e) and not isinstance(e, MemoryError):
        return f"{e} ({OOM_HINT})"
    return f"{e} ({TIMEOUT_HINT})" if _TIMED_OUT.search(str(e)) else str(e)


def bad_input(e: BaseException) -> bool:
    """Whether ``e`` says that the job's input is bad (a ``ValueError``: a data line, a flag,
    a checkpoint, a run another job writes; a ``FloatingPointError``: settings under which
    the loss diverged; a path that is missing, of the wrong kind or not permitted; an
    ``ImportError``: a library the options need is not installed; an ``OSError`` of a
    filesystem without room, :data:`NO_ROOM`; the host's or the GPU's memory too small for
    the settings, :func:`out_of_memory`), which
    the same command line would raise again; not bytes damaged on their way from a peer (a
    ``PayloadError`` anywhere in its chain), which need not be damaged again, nor other
    ``OSError``s (a network file system's hiccup)."""
    from recsz.codecs.payload import PayloadError

    if (isinstance(e, OSError) and e.errno in NO_ROOM) or out_of_memory(e):
        return True
    if not isinstance(e, _BAD_INPUT):
        return False
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, PayloadError):
            return False
        seen = seen.__cause__ or seen.__context__
    return True


def failure_kind(e: BaseException) -> str:
    """What kind of bad input ``e`` says, as the launcher's line names it: ``out of
    memory``, ``no room on disk`` or ``bad input``."""
    if out_of_memory(e):
        return "out of memory"
    return "no room on disk" if isinstance(e, OSError) and e.errno in NO_ROOM else "bad input"


def restarted() -> bool:
    """Whether this rank's job was started again after a failure (by
    :func:`recsz.launcher.launch`, or by a plain torchrun's agent)."""
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
        from recsz.console import plain_warnings

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
    :data:`BAD_INPUT` (:func:`recsz.launcher.launch` names it, for all ranks), else 1, its
    traceback kept for recsz's agent to show (:func:`recsz.launcher._report`). Raised, for
    its traceback on stderr, where ``RECSZ_TRACEBACK`` asks for it and under a plain
    torchrun's agent (whose report shows it). Called while ``e`` is handled."""
    line = f"{type(e).__name__}: {said(e)}"
    folder, bad = os.environ.get(FAILURES), bad_input(e)
    if not (folder and bad):
        print(f"recsz: rank {rank} failed: {line}", file=sys.stderr, flush=True)
    if os.environ.get("RECSZ_TRACEBACK") or not (bad or os.environ.get(AGENT)):
        raise e
    if not bad:
        _record(e)
        return 1
    if folder:
        Path(folder).mkdir(mode=0o700, exist_ok=True)
        with _whole(Path(folder) / f"rank-{rank}") as part:
            part.write_text(f"{failure_kind(e)}\n{line}")
    return BAD_INPUT


def _record(e: BaseException) -> None:
    """``e``'s record (torchrun's ``ErrorHandler``) in the file torchrun's agent reads
    (``TORCHELASTIC_ERROR_FILE``), whole or not at all (:func:`_whole`): an empty one, left
    by a rank the agent closed while it wrote, failed the agent's own parse, whose
    JSONDecodeError's traceback then took the place of :func:`recsz.launcher`'s report."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    target = os.environ.get(ERROR_FILE)
    if not target:  # (not under torchrun's agent: nowhere to write, as ErrorHandler finds)
        return
    try:
        with _whole(Path(target)) as part:
            os.environ[ERROR_FILE] = str(part)
            ErrorHandler().record_exception(e)
    except OSError:  # (no room: no record; the rank's line is said)
        pass
    finally:
        os.environ[ERROR_FILE] = target


@contextlib.contextmanager
def _whole(target: Path) -> Iterator[Path]:
    """A failed rank's file for its launcher, written whole or not at all: the path to
    write (hidden beside ``target``, out of :func:`recsz.launcher.noted`'s glob), renamed
    onto ``target`` once written, removed where writing failed. torchrun's agent closes the
    other ranks with SIGTERM as soon as one fails, and a rank that failed in the same moment
    (its peer's connection lost, the same bad input) could be ended mid-write. So SIGTERM or
    SIGINT coming meanwhile is noted (a handler, not a blocked mask: a mask is the calling
    thread's, and gloo's threads would take the signal) and ends the process after, as the
    signal's default ends it (the rank is done; no KeyboardInterrupt's traceback)."""
    came: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # (handlers: its alone)
    previous = {sig: signal.signal(sig, lambda s, _f: came.append(s)) for sig in heeded()
                if main}  # fmt: skip
    part = target.with_name(f".{target.name}.part")
    try:
        yield part
        os.replace(part, target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if came:
            sys.stderr.flush()
            signal.signal(came[0], signal.SIG_DFL)
            signal.raise_signal(came[0])


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
