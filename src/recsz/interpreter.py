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
        import triton
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
    lighter_types(tl.core, getattr(triton, "__version__", ""))


def lighter_types(core: Any, version: str) -> None:
    """Costs of Triton's front end that the interpreter pays at every operation of every
    program (a fifth of our device-path tests' time): every tensor's shape is a
    ``tl.tuple``, whose type (a ``tuple_type`` of each element's) is now made when first
    read, and whose type's name (a string of every element's type) is spelled when read
    (only messages read it); a block type unwraps its shape in one pass where it is of
    integers (through two generic passes that build such tuples again otherwise). The
    same values, types, names, equality and hashes, made later. Written against Triton
    3.6's front end (the release the GPU machines and ``make`` install): another release
    is left as it is."""
    names = ("tuple_type", "tuple", "_unwrap_shape", "constexpr", "_type_for_tuple_values")
    got: list[Any] = [getattr(core, n, None) for n in names]
    if not version.startswith("3.6.") or any(g is None for g in got):
        return
    tuple_type, tl_tuple, unwrap, constexpr, type_of = got
    if getattr(unwrap, "_recsz", False):
        return

    def tuple_type_init(self: Any, types: Any, fields: Any = None) -> None:
        self.types = types
        self.fields = fields or [""] * len(types)

    def tuple_type_name(self: Any) -> str:
        return (
            "["
            + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types, strict=False)])
            + "]"
        )

    def tuple_init(self: Any, args: Any, type: Any = None) -> None:
        self.values = list(args)
        if type is not None:  # (else made when read)
            self.type = type if isinstance(type, tuple_type) else tuple_type(type)

    def tuple_value_type(self: Any) -> Any:
        t = self.__dict__.get("_recsz_type")
        if t is None:
            t = self.__dict__["_recsz_type"] = type_of(self.values)
        return t

    def set_tuple_value_type(self: Any, t: Any) -> None:
        self.__dict__["_recsz_type"] = t

    def unwrap_shape(shape: Any) -> Any:
        seq = shape.value if isinstance(shape, constexpr) else shape
        seq = seq.values if isinstance(seq, tl_tuple) else seq
        if isinstance(seq, list | tuple):
            out = [s.value if isinstance(s, constexpr) else s for s in seq]
            if all(type(s) is int for s in out):
                return out
        return unwrap(shape)

    unwrap_shape._recsz = True  # type: ignore[attr-defined]
    tuple_type.__init__ = tuple_type_init
    tuple_type.name = property(tuple_type_name)
    tl_tuple.__init__ = tuple_init
    tl_tuple.type = property(tuple_value_type, set_tuple_value_type)
    core._unwrap_shape = unwrap_shape


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
