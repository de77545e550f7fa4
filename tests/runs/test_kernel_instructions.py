"""The FP8 cast kernel's machine code, checked without a GPU: Triton compiles it for Hopper (sm_90) on any host,
and its bundled cuobjdump lists the instructions. A cast moves 4 bytes an element; an H100 issues
about 128 thread-instructions a clock per SM, so at 3.35 TB/s the cast stays memory-bound up to about 40
instructions an element, an H200 (4.8 TB/s) about 28. The kernel once took 52 (its amax reduced row by row, bounds
masks on whole tiles) and ran at 1.3x its copy floor, and its GELU form spilled registers to local memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMPILE = r"""
import json, re, subprocess, sys, tempfile
from pathlib import Path
import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flux_train.kernels import fp8_cast

kernel = getattr(fp8_cast, sys.argv[3])
types = {"X": "*bf16", "TAIL": "*bf16", "X2": "*bf16", "Q": "*fp8e4nv", "QT": "*fp8e4nv", "Q2": "*fp8e4nv",
         "QT2": "*fp8e4nv", "SCALE": "*fp32", "AMAX": "*fp32", "S_OUT": "*fp32", "S_OUT2": "*fp32",
         "SUMS": "*fp32", "M": "i32", "K_HEAD": "i32", "SX": "i32", "ST": "i32", "M2": "i32", "K": "i32"}
bm, bk, _ = fp8_cast._TILE
const, warps = json.loads(sys.argv[1]), int(sys.argv[2])
const.update(FMAX=448.0, LAYOUTS=3, COLUMN_SUMS=False, INTERPRETED=False, BM=bm, BK=bk)
names = kernel.arg_names
const = {n: v for n, v in const.items() if n in names}  # the second kernel takes no column sums
signature = {n: "constexpr" if n in const else types[n] for n in names}
compiled = triton.compile(ASTSource(kernel, signature, {(names.index(n),): v for n, v in const.items()}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
tool = str(Path(nvidia.__file__).parent / "bin" / "cuobjdump")
with tempfile.TemporaryDirectory() as folder:
    cubin = Path(folder) / "cast.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
# one SASS instruction a line: /*offset*/ [predicate] OPCODE ...; local memory loads and stores are spills
print(json.dumps({
    "instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P[0-9T] )?[A-Z]", sass, re.M)),
    "spills": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
}))
"""


def compiled(warps: int, kernel: str = "_cast_transpose_kernel", **constants) -> dict:
    """A cast kernel compiled for sm_90 with these constexprs: its SASS instructions and local-memory spills.
    In a process of its own: the tests run Triton's interpreter (TRITON_INTERPRET, set before
    Triton is imported), whose kernels do not compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(constants), str(warps), kernel],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_fp8_cast_kernel_fits_an_h200_s_memory_bound_budget_and_spills_nothing():
    """The kernel holds two copies of the tile's code (the GEMM's first operand and its weight, cast together): the
    plain cast's instructions an element = count / 2 / (elements a thread). With the GELU (the launch's own warps),
    no register spills to local memory; nor in the plain kernel that casts the operands without a history (the
    first steps)."""
    pytest.importorskip("triton.backends.nvidia")
    from flux_train.kernels.fp8_cast import _GELU_WARPS, _SWEEP_WARP_FACTOR, _TILE

    bm, bk, warps = _TILE
    per_thread = bm * bk // (32 * warps)
    whole = compiled(warps, GELU=False, EVEN=True)
    ragged = compiled(warps, GELU=False, EVEN=False)
    gelu = compiled(_GELU_WARPS, GELU=True, EVEN=True)
    sweep = compiled(warps * _SWEEP_WARP_FACTOR, "_cast_without_history_kernel", GELU=False, EVEN=True)
    plain = whole["instructions"] / 2 / per_thread
    assert plain <= 28, f"{plain:.1f} SASS instructions an element: issue-bound on an H200"
    # ragged tiles (no Flux operand's) pay the bounds masks, and the stores' branch (no history: the maximum only)
    # keeps them apart from the tile's load: 45 an element, slightly issue-bound on an H100
    assert ragged["instructions"] / 2 / per_thread <= 48, "ragged operands: more instructions than measured"
    assert whole["spills"] == 0 and gelu["spills"] == 0, (whole, gelu)
    assert sweep["spills"] == 0, sweep
