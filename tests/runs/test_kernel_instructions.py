"""The FP8 cast kernel's instruction budget, checked without a GPU: Triton compiles it for Hopper (sm_90) on any
host, and its bundled cuobjdump lists the machine code. A cast moves 4 bytes an element; an H100 issues about
128 thread-instructions a clock per SM, so at 3.35 TB/s the cast stays memory-bound up to about 40 instructions an
element, an H200 (4.8 TB/s) about 28. The kernel once took 52 (its amax reduced row by row, bounds masks on whole
tiles) and ran at 1.3x its copy floor; this holds it under the H200's budget."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

COUNT = r"""
import collections, json, re, subprocess, sys, tempfile
from pathlib import Path
import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flux_train.kernels import fp8_cast

kernel = fp8_cast._cast_transpose_kernel
types = {"X": "*bf16", "TAIL": "*bf16", "X2": "*bf16", "Q": "*fp8e4nv", "QT": "*fp8e4nv", "Q2": "*fp8e4nv",
         "QT2": "*fp8e4nv", "SCALE": "*fp32", "AMAX": "*fp32", "ARRIVALS": "*i32", "S_OUT": "*fp32", "S_OUT2": "*fp32",
         "SUMS": "*fp32", "M": "i32", "K_HEAD": "i32", "SX": "i32", "ST": "i32", "M2": "i32", "K": "i32"}
bm, bk, warps = fp8_cast._TILE
const = dict(FMAX=448.0, LAYOUTS=3, COLUMN_SUMS=False, COUNTED=False, INTERPRETED=False, BM=bm, BK=bk,
             **json.loads(sys.argv[1]))
names = kernel.arg_names
signature = {n: "constexpr" if n in const else types[n] for n in names}
compiled = triton.compile(ASTSource(kernel, signature, {(names.index(n),): v for n, v in const.items()}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
with tempfile.TemporaryDirectory() as folder:
    cubin = Path(folder) / "cast.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
# one SASS instruction a line: /*offset*/ [predicate] OPCODE ...
print(len(re.findall(r"^\s+/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P[0-9T] )?[A-Z]", sass, re.M)))
"""


def instructions(**constants) -> int:
    """SASS instructions of the cast kernel compiled for sm_90 with these constexprs. In a process of its own:
    the tests run Triton's interpreter (TRITON_INTERPRET, set before Triton is imported), whose kernels do not
    compile."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", COUNT, json.dumps(constants)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_the_fp8_cast_of_whole_tiles_stays_within_an_h200_s_memory_bound_budget():
    """The kernel holds two copies of the tile's code (the GEMM's first operand and its weight, one launch), each
    for BM x BK elements over 4 warps: instructions an element = count / 2 / (BM * BK / 128)."""
    pytest.importorskip("triton.backends.nvidia")
    from flux_train.kernels.fp8_cast import _TILE

    bm, bk, warps = _TILE
    per_thread = bm * bk // (32 * warps)
    plain = instructions(GELU=False, EVEN=True) / 2 / per_thread
    ragged = instructions(GELU=False, EVEN=False) / 2 / per_thread
    assert plain <= 28, f"{plain:.1f} SASS instructions an element: issue-bound on an H200"
    assert ragged <= 40, f"{ragged:.1f} SASS instructions an element on ragged operands: issue-bound on an H100"
    assert plain < ragged  # whole tiles go without bounds checks
