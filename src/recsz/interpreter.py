"""Triton's interpreter (``TRITON_INTERPRET=1``: CI runs the GPU kernels on the CPU) made
cheaper where it repeats itself; nothing here runs on a GPU or changes a result.

Every call of a ``@triton.jit`` function from inside a kernel (``tl.max``, ``tl.sum`` and
our own helpers among them) re-patches ``triton.language`` through ``inspect.getmembers``
(about a millisecond each, tens of thousands of calls a test run: a quarter of the time of
our device-path tests). Within one kernel launch nothing undoes a patch, so a second one of
the same modules finds every builtin already replaced and sets the same attributes again:
:func:`install` skips it, and forgets what it skipped when the next launch begins. It
also remembers the numpy dtype of each Triton type, which the interpreter looks up
through a table it builds at every call (a tenth of the same tests' time). Where
Triton's internals are not what this was written against (another release), it does
nothing.
"""

from __future__ import annotations

import functools
import os
from typing import Any


def interpreted() -> bool:
    """Whether Triton's kernels run under its interpreter (on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def install() -> None:
    """Skip the interpreter's repeated patches within a launch (once per process; only
    under ``TRITON_INTERPRET=1``)."""
    if not interpreted():
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    patch = getattr(ti, "_patch_lang", None)
    run = getattr(ti, "GridExecutor", None)
    run = run.__call__ if run is not None else None
    scope = getattr(ti, "_LangPatchScope", None)
    if patch is None or run is None or scope is None or getattr(patch, "_recsz", False):
        return
    done: set[frozenset[int]] = set()

    def modules(fn: Any) -> frozenset[int]:
        """The modules the interpreter patches for ``fn``: Triton's language as it sees them."""
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    @functools.wraps(patch)
    def patch_once(fn: Any) -> Any:
        key = modules(fn)
        if key in done:
            return scope()
        done.add(key)
        return patch(fn)

    @functools.wraps(run)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        done.clear()  # the launch's own patch comes first and is undone at its end
        try:
            return run(self, *args, **kwargs)
        finally:
            done.clear()

    patch_once._recsz = True  # type: ignore[attr-defined]
    ti._patch_lang = patch_once
    ti.GridExecutor.__call__ = launch
    np_dtype = getattr(ti, "_get_np_dtype", None)
    if np_dtype is not None and hasattr(tl, "block_type") and hasattr(tl, "pointer_type"):
        ti._get_np_dtype = scalar_cached(np_dtype, tl)


def scalar_cached(of: Any, tl: Any) -> Any:
    """The interpreter's numpy dtype of a Triton type, which builds its table of every type
    anew at each of its calls (tens of thousands a test): asked once a scalar type, a
    block's its element's (as it answers them)."""
    seen: dict[Any, Any] = {}

    @functools.wraps(of)
    def np_dtype(tt: Any) -> Any:
        el = tt.element_ty if isinstance(tt, tl.block_type) else tt
        if isinstance(el, tl.pointer_type):
            return of(tt)
        got = seen.get(el)
        if got is None:
            got = seen[el] = of(el)
        return got

    return np_dtype
