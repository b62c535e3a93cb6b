"""What a step would make a GPU wait for, counted on the CPU.

With ``RECSZ_DEVICE_PATH_ON_CPU=1`` (and Triton's interpreter) the codecs, bounds and row
optimizer take their GPU code paths on the CPU, but a CPU cannot tell a host read of device
memory from any other read. :class:`HostReads` tells them apart by following which tensors
would live on the device: the model's state and the batch to begin with, then whatever a
torch operation makes from one of them or writes into with one of them, whatever a Triton
kernel is handed, and what :func:`recsz.codecs.payload.upload` puts there. On such a
tensor it counts what makes a host wait for a GPU (torch's sync debug mode would report
it): a value read (``.item()``, ``float()``, ``bool()``, ``.tolist()``, ``.numpy()``) and
every operation whose output's size depends on the values (``nonzero``, ``unique``,
``masked_select``, ``bincount``, boolean indexing, ``repeat_interleave`` without its
size). It also counts uploads, which a CUDA graph cannot replay, and launches: the
operations on such tensors that would launch work on a GPU (not views, allocations or
metadata) and the Triton kernels, each a few microseconds of host time on a GPU however
small its work.
"""

from __future__ import annotations

import collections
import sys
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_MARK = "_recsz_on_device"

#: Operations whose output's size is read from the values of their input.
_SIZED_BY_VALUES = {
    "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select", "bincount",
    "equal", "is_nonzero", "allclose",
}  # fmt: skip


#: Operations that launch nothing on a GPU besides views: allocations and metadata.
_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "_unsafe_view", "set_", "resize_", "lift_fresh"}  # fmt: skip

#: Factories whose tensors are the device's when given a ``device=``.
_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange")


def on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def mark(tensors: Iterable[Any]) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            setattr(t, _MARK, True)


def _site() -> str:
    """Where in recsz (innermost first) the read was made."""
    frames = [f for f in traceback.extract_stack() if "/recsz/" in f.filename]
    where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[::-1]]
    return " <- ".join(where[:4])


class HostReads(TorchDispatchMode):
    """While active: ``reads`` (what, where) -> count, ``uploads``, and ``launches`` (operation
    or kernel name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self.uploads = 0
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        ins = pytree.tree_leaves((args, kwargs))
        if not any(on_device(t) for t in ins):
            return out
        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in _NO_LAUNCH:
            self.launches[name] += 1
        if (
            name == "_local_scalar_dense"
            or name in _SIZED_BY_VALUES
            or _sized_by_mask(name, args, kwargs)
        ):
            self.reads[(name, _site())] += 1
        mark(pytree.tree_leaves(out))
        if func._schema.is_mutable:  # written with device values: the device's
            mark(a for a, s in zip(args, func._schema.arguments, strict=False) if s.is_write)
        return out

    def total(self) -> int:
        return sum(self.reads.values())

    def take(self) -> tuple[int, int, str]:
        """(reads, uploads, where) since the last take; counting starts again (``launches``
        too: read them first)."""
        got = (self.total(), self.uploads, self.report())
        self.reads.clear()
        self.launches.clear()
        self.uploads = 0
        return got

    def report(self) -> str:
        return "\n".join(f"{n} x {what} at {where}" for (what, where), n in self.reads.items())

    def ours_after_input_dist(self) -> tuple[int, str]:
        """(reads, where) made in recsz but not in a sharded module's ``input_dist`` (the
        sharder calls TorchRec's there) since the last take; counting starts again."""
        ours = {
            k: n
            for k, n in self.reads.items()
            if k[1] and not k[1].split(" <- ")[0].endswith(" input_dist")
        }
        got = (sum(ours.values()), self.report())
        self.take()
        return got


def _sized_by_mask(name: str, args: Any, kwargs: Any) -> bool:
    """Boolean indexing, host indices of device values, repeat_interleave without a size."""
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        idx = [i for i in args[1] or () if isinstance(i, torch.Tensor)]
        host = on_device(args[0]) and any(i.dim() and not on_device(i) for i in idx)
        return host or any(i.dtype == torch.bool for i in idx)
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    return False


@contextmanager
def counting(device_state: Iterable[torch.Tensor]) -> Iterator[HostReads]:
    """Count the host reads and uploads of what runs inside (:meth:`HostReads.take` step
    by step); ``device_state``: the tensors that start on the device (model, optimizer
    states; mark each batch's with :func:`mark`). Enter it before the first step: tensors
    that steps make once and keep (index tensors, constants) are then known as the
    device's (the codecs' plans and constants are forgotten here, to be made inside)."""
    import triton.runtime.interpreter as interp

    from recsz.codecs import blockcoder, payload

    # What the codecs keep on the device between calls is made again, inside.
    blockcoder.clear_plans()
    payload.forget_constants()
    mark(device_state)
    mode = HostReads()
    launch, upload = interp.GridExecutor.__call__, payload.upload
    value_reads = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy")}

    def kernel(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not mode.paused:
            mode.launches[getattr(self.fn, "__name__", "triton kernel")] += 1
        mode.paused = True  # the interpreter's own copies in and out
        try:
            return launch(self, *args, **kwargs)
        finally:
            mode.paused = False
            mark(pytree.tree_leaves((args, kwargs)))  # what a kernel writes is the device's

    def uploaded(*args: Any, **kwargs: Any) -> torch.Tensor:
        mode.uploads += 1
        mode.launches["upload"] += 1  # a copy from the host
        t = upload(*args, **kwargs)
        mark([t])
        return t

    def read(what: str) -> Any:
        def f(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if on_device(self) and not mode.paused:
                mode.reads[(what, _site())] += 1
            return value_reads[what](self, *a, **k)

        return f

    def placed(name: str, make: Any) -> Any:
        def f(*args: Any, **kwargs: Any) -> Any:
            t = make(*args, **kwargs)
            if kwargs.get("device") is not None:
                copied = name in ("tensor", "as_tensor") and not (args and on_device(args[0]))
                if copied and not mode.paused:  # host values copied from pageable memory
                    mode.reads[(f"{name}(host values, device=)", _site())] += 1
                if name != "empty" and not mode.paused:  # made there: a kernel or a copy
                    mode.launches[name] += 1
                mark([t])
            return t

        return f

    factories = {n: getattr(torch, n) for n in _FACTORIES}
    holders = [m for n, m in list(sys.modules.items()) if n.startswith("recsz")]
    holders = [m for m in holders if getattr(m, "upload", None) is upload]
    interp.GridExecutor.__call__ = kernel
    for m in holders:
        m.upload = uploaded
    for n in value_reads:
        setattr(torch.Tensor, n, read(n))
    for n, make in factories.items():
        setattr(torch, n, placed(n, make))
    try:
        with mode:
            yield mode
    finally:
        interp.GridExecutor.__call__ = launch
        for m in holders:
            m.upload = upload
        for n, f in value_reads.items():
            setattr(torch.Tensor, n, f)
        for n, make in factories.items():
            setattr(torch, n, make)
