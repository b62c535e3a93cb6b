"""Compile every format-3 kernel for an sm_90 (Hopper) GPU, no GPU needed (Triton ships
its own ptxas): run without TRITON_INTERPRET by tests/test_blocks.py. Prints one line per
kernel; exits 1 if any fails to compile."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from recsz.codecs import blockkernels as k

B64 = {"B": 64}
PTRS = {"src_ptr": "*i64", "w_ptr": "*u8", "off_ptr": "*i64", "base_ptr": "*i64"}
KERNELS = {
    k.quantize_kernel: (
        {"x_ptr": "*fp32", "map_ptr": "*i64", "eb_ptr": "*fp64", "zz_ptr": "*i32",
         "raw_ptr": "*i8", "n": "i64", "dim": "i32", "qmax": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 2048},
    ),
    k.widths_kernel: (
        {"src_ptr": "*i64", "code_ptr": "*i32", "ref_ptr": "*i32", "raw_ptr": "*i8",
         "w_ptr": "*u8", "nb": "i32", "B": "constexpr"},
        B64,
    ),
    k.pack_kernel: (
        {"src_ptr": "*i64", "code_ptr": "*i32", "ref_ptr": "*i32", "xbits_ptr": "*i32",
         "map_ptr": "*i64", "dim": "i32", "w_ptr": "*u8", "off_ptr": "*i64",
         "base_ptr": "*i64", "out32_ptr": "*i32", "part_ptr": "*i32", "nb": "i32",
         "B": "constexpr"},
        B64,
    ),
    k.unpack_kernel: (
        {**PTRS, "in32_ptr": "*i32", "n_words": "i64", "eb_ptr": "*fp64", "dim": "i32",
         "out_ptr": "*fp32", "ref_ptr": "*i32", "part_ptr": "*i32", "nb": "i32",
         "B": "constexpr", "CODES": "constexpr", "REFS": "constexpr"},
        {"B": 64, "CODES": True, "REFS": True},
    ),
    k.row_key_kernel: (
        {"bits_ptr": "*i32", "mult_ptr": "*i64", "piece_ptr": "*i64", "pad_ptr": "*i8",
         "key_ptr": "*i64", "n_rows": "i32", "hash_mask": "i64", "shift": "i32",
         "dim": "constexpr", "ROWS": "constexpr", "DB": "constexpr"},
        {"dim": 48, "ROWS": 32, "DB": 32},
    ),
    k.same_rows_kernel: (
        {"bits_ptr": "*i32", "a_ptr": "*i64", "b_ptr": "*i64", "out_ptr": "*i8", "n": "i32",
         "dim": "constexpr", "ROWS": "constexpr", "DB": "constexpr"},
        {"dim": 48, "ROWS": 32, "DB": 32},
    ),
}  # fmt: skip


def main() -> int:
    failed = 0
    for fn, (sig, const) in KERNELS.items():
        names = list(sig)
        src = ASTSource(
            fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()}
        )
        try:
            triton.compile(src, target=GPUTarget("cuda", 90, 32))
            print(fn.__name__, "ok")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(fn.__name__, "FAILED:", type(e).__name__, str(e)[:2000])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
