"""recsz.interpreter: Triton's interpreter patches its language once a launch, not once a
device-function call, and kernels give what they gave before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from recsz.interpreter import interpreted

pytestmark = pytest.mark.skipif(not interpreted(), reason="Triton's interpreter is off (a GPU)")


@triton.jit
def _row_max(v):
    return tl.max(v, axis=1)


@triton.jit
def max_of_rows_kernel(x_ptr, out_ptr, CALLS: tl.constexpr, W: tl.constexpr):
    """out[p] = CALLS x the largest of row p (device functions called CALLS times)."""
    p = tl.program_id(0)
    v = tl.load(x_ptr + p * W + tl.arange(0, W))[None, :]
    acc = tl.zeros([1], dtype=tl.int32)
    for _ in tl.static_range(CALLS):
        acc += _row_max(v)
    tl.store(out_ptr + p + tl.arange(0, 1), acc)


def patches(monkeypatch: pytest.MonkeyPatch, calls: int, x: torch.Tensor) -> tuple[int, list]:
    """How many times the interpreter patched a module of Triton's language in one launch of
    the kernel above, and what the kernel wrote."""
    from triton.runtime import interpreter as ti

    seen = []
    real = ti._patch_builtin
    monkeypatch.setattr(ti, "_patch_builtin", lambda *a: seen.append(a[0]) or real(*a))
    out = torch.zeros(x.shape[0], dtype=torch.int32)
    max_of_rows_kernel[(x.shape[0],)](x, out, CALLS=calls, W=x.shape[1])
    monkeypatch.undo()
    return len(seen), out.tolist()


def test_device_function_calls_patch_the_language_once_a_launch(monkeypatch) -> None:
    x = torch.tensor(np.random.default_rng(0).integers(-50, 50, (3, 8)), dtype=torch.int32)
    patches(monkeypatch, 1, x)  # the first launch makes some first-time calls of its own
    once, got1 = patches(monkeypatch, 1, x)
    many, got9 = patches(monkeypatch, 9, x)
    again, _ = patches(monkeypatch, 9, x)  # a later launch patches as the one before did
    top = x.amax(1)
    assert got1 == top.tolist() and got9 == (9 * top).tolist()
    assert 0 < once == many == again


def test_the_cached_numpy_dtypes_are_the_interpreters() -> None:
    """Each Triton type's numpy dtype, remembered per scalar type, is the one the
    interpreter's own function gives it: scalars, blocks of each, pointers and blocks of
    pointers, asked twice."""
    from triton.runtime import interpreter as ti

    from recsz.interpreter import scalar_cached

    original = ti._get_np_dtype.__wrapped__  # what install() wrapped
    cached = scalar_cached(original, tl)
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
               tl.int64, tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64]  # fmt: skip
    types = [*scalars, *(tl.block_type(t, [4]) for t in scalars), tl.pointer_type(tl.float32)]
    types.append(tl.block_type(tl.pointer_type(tl.int32), [8]))
    for t in types * 2:
        assert cached(t) == original(t), t
    assert ti._get_np_dtype is not original  # installed


_TYPES_SCRIPT = """
import json, triton.language as tl
from triton.language import core
c, tt = core.constexpr, core.tuple_type
values = [core.tuple([1, 2, 3]), core.tuple([c(4), c(8)]), core.tuple([core.tuple([1]), c(2)]),
          core.tuple([tl.int32, tl.float32]), core.tuple([c(1)], tt([tl.int32], ["a"]))]
blocks = [core.block_type(tl.float32, [4, 8]), core.block_type(tl.int8, core.tuple([c(16)])),
          core.block_type(tl.int64, [c(2), 4])]
out = {"tuples": [[str(v.type), v.type.name, repr(v), str(v), len(v.type.types)]
                  for v in values],
       "blocks": [[b.name, str(b), list(b.shape), b.numel] for b in blocks],
       "equal": [[a.type == b.type for b in values] for a in values],
       "field": values[4].a.value}
values[0]._setitem(1, c(7))
out["set"] = [str(values[0].type), repr(values[0])]
print(json.dumps(out))
"""


def test_the_lighter_types_are_the_front_ends_own(tmp_path) -> None:
    """Triton's tuples, tuple types and block types made with the interpreter's lighter
    front end (recsz.interpreter.lighter_types, installed with recsz) have the names, values,
    hashes and equalities Triton's own give them (a process that never patched them)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    plain = subprocess.run([sys.executable, "-c", _TYPES_SCRIPT], env=env, check=True,
                           capture_output=True, text=True).stdout  # fmt: skip
    from triton.language import core

    assert getattr(core._unwrap_shape, "_recsz", False), "the lighter front end is not installed"
    here: dict = {}
    exec(_TYPES_SCRIPT.replace("print(json.dumps(out))", ""), here)
    assert json.loads(json.dumps(here["out"])) == json.loads(plain)
