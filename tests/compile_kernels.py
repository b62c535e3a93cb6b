"""Compile every format-3 kernel for an sm_90 (Hopper) GPU, no GPU needed (Triton ships
its own ptxas): run without TRITON_INTERPRET by tests/test_blocks.py. Prints one line per
kernel; exits 1 if any fails to compile."""

from __future__ import annotations

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from recsz.codecs import blockkernels as k
from recsz.codecs import blockunpack as u
from recsz.policy import rangekernel

#: The type of each argument name, as the coder passes it (per kernel where they differ).
TYPES = {
    **dict.fromkeys(
        [
            "bits_ptr",
            "seg_ptr",
            "lit_ptr",
            "cz_ptr",
            "rgroup_ptr",
            "refs_ptr",
            "zz_ptr",
            "refg_ptr",
            "bgid_ptr",
            "xbits_ptr",
            "out32_ptr",
            "ck_ptr",
            "words_ptr",
            "bad_ptr",
            "in32_ptr",
            "slotseg_ptr",
            "rseg_ptr",
        ],
        "*i32",
    ),
    **dict.fromkeys(
        [
            "mult_ptr",
            "key_ptr",
            "tab_ptr",
            "first_ptr",
            "dup_ptr",
            "rfirst_ptr",
            "rslot_ptr",
            "row0_ptr",
            "npad_ptr",
            "map_ptr",
            "nlit_ptr",
            "size_ptr",
            "bs_ptr",
            "nrb_ptr",
            "rb0_ptr",
            "base_ptr",
            "wat_ptr",
            "cs_ptr",
            "fat_ptr",
            "ebat_ptr",
            "nbmax_ptr",
            "k_ptr",
            "seg0_ptr",
            "hfix_ptr",
            "used_ptr",
            "ipos_ptr",
            "ibounds_ptr",
            "dlen_ptr",
            "src_ptr",
            "end_ptr",
            "out_ptr",
            "pfirst_ptr",
            "pseg_ptr",
            "arange_ptr",
        ],
        "*i64",
    ),
    **dict.fromkeys(["w_ptr", "out8_ptr", "buf_ptr", "ival_ptr"], "*u8"),
    "x_ptr": "*fp32",
    "lo_ptr": "*fp32",
    "hi_ptr": "*fp32",
    "s_t": "i64",
    "s_b": "i64",
    "n_b": "i32",
    "n_chunks": "i32",
    "f_ptr": "*fp64",
    "clamp_ptr": "*fp64",
    "y_ptr": "*fp32",
    "ebs_ptr": "*fp64",
    "ok_ptr": "*i8",
    **dict.fromkeys(["n_rows", "shift", "qmax", "n_ref", "nb", "rows", "n_pieces", "g"], "i32"),
    **dict.fromkeys(["n_blocks", "p_steps", "g_steps"], "i32"),
    **dict.fromkeys(["hash_mask", "n", "n_bytes", "n_words", "mask"], "i64"),
}
PER_KERNEL = {
    "pack_kernel": {"lit_ptr": "*i64"},
    "head_kernel": {"lit_ptr": "*i64", "ebs_ptr": "*i64"},
    "read_head_kernel": {"lit_ptr": "*i64", "ebs_ptr": "*i64"},
    "read_widths_kernel": {"lit_ptr": "*i64"},
    "unpack_kernel": {"lit_ptr": "*i64", "out_ptr": "*fp32"},
    "verdict_kernel": {"lit_ptr": "*i64"},
    "gather_rows_kernel": {"out_ptr": "*fp32"},
    "bound_kernel": {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "out_ptr": "*fp64"},
    "word_sum_kernel": {"first_ptr": "*i64", "len_ptr": "*i64", "out_ptr": "*i32"},
}
CONST = {
    **{"DIM": 48, "ROWS": 32, "DB": 32, "B": 64, "BLOCK": 2048, "DP": 64, "CHUNK": 4096, "CH": 128},
    **{"REFS": False},
}


def main() -> int:
    failed = 0
    kernels = [v for m in (k, u, rangekernel) for v in vars(m).values()
               if isinstance(v, triton.JITFunction) and v.__name__.endswith("_kernel")]  # fmt: skip
    variants = [(fn, CONST) for fn in kernels] + [(u.unpack_kernel, {**CONST, "REFS": True})]
    for fn, consts in variants:
        names = list(inspect.signature(fn.fn).parameters)
        types = {**TYPES, **PER_KERNEL.get(fn.__name__, {})}
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        const = {(names.index(n),): consts[n] for n in names if n in consts}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                           target=GPUTarget("cuda", 90, 32))  # fmt: skip
            print(fn.__name__, "ok")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(fn.__name__, "FAILED:", type(e).__name__, str(e)[:3000])
    print(len(variants), "kernels,", failed, "failed")
    return 1 if failed or not kernels else 0


if __name__ == "__main__":
    sys.exit(main())
