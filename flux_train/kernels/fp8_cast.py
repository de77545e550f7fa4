"""One pass from a bf16 GEMM operand to its e4m3 forms: `cast_transpose(x, scale, amax, dtype)`.

FP8 tensor cores on Hopper take both operands K-major, so the backward needs every operand in the other layout
too. One kernel reads a 2-D bf16 tensor once and writes the e4m3 values in both layouts (4 bytes moved per
element, the floor for an operand both layouts of which are used), and folds |x|'s maximum into `amax` with
an atomic max, so the amax of the next step's scale costs no pass of its own.

`scale` is the dequantisation scale s (x ~= q * s) from an amax history (delayed scaling, 0-dim fp32 device
tensor). Where it is 0 (no history yet: the first steps of delayed scaling, every step of the tensorwise recipe)
the cast uses amax / max(e4m3), current scaling, decided on the GPU, so the same captured graph serves both: the
first kernel's programs then only fold their tiles into `amax`, and a second kernel, launched after every cast,
casts the tensor once the maximum is whole (a persistent grid; with a history its programs end at once, a launch
of a few microseconds). The first steps read each operand twice; before, the last program to arrive cast the
whole tensor alone (one SM), which made the whole model's first steps at micro-batch 32 cost 65-135 s.
Returns (q or, without `rows`, an empty tensor, q transposed or an empty tensor, the scale used, and with
`column_sums` x's fp32 sums over its rows: a bias gradient when x is the output gradient, at no extra read); the
kernels' LAYOUTS says which it writes (1: q, 2: q transposed, 3: both). `cast_transpose_pair` casts a GEMM's two
forward operands (x and W, the same K) in the same two launches: inside a captured step the launches, not the
bytes, are what the small casts cost. The pair's first operand can come as [head | gelu(tail)]: the kernel applies
the GELU (torch's tanh approximation, rounded to bf16 as torch's GELU writes it) and the join as it reads,
so a GELU's output is never written in bf16 to be read again by its cast (`gelu_tail`, FP8Linear.gelu_forward).

The Triton path is a `torch.library.triton_op`: torch.compile calls the kernels as they are (Inductor does not
re-trace them) and CUDA graphs capture them. `cast_transpose_torch` is the same in torch ops: the CPU path
and the tests' reference.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton  # plain torch: importable without Triton

from flux_train.kernels.triton_support import HAVE_TRITON, interpreted, kernels_run_on, libdevice, tl, triton

TINY_AMAX = 1e-12  # an all-zero tensor (a gradient before the gates open) casts to zeros, not NaN


def cast_transpose_torch(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    transpose: bool = True,
    column_sums: bool = False,
    rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(dtype).max
    amax.copy_(torch.maximum(amax, x.abs().amax().float()))
    s = torch.where(scale > 0, scale, amax.clamp(min=TINY_AMAX) / fmax).reshape(())
    q = (x.float() * (1.0 / s)).clamp(-fmax, fmax).to(dtype)
    sums = x.float().sum(0) if column_sums else x.new_empty(0, dtype=torch.float32)
    return q if rows else q.new_empty(0), q.t().contiguous() if transpose else q.new_empty(0), s, sums


if HAVE_TRITON:
    _TINY_AMAX = tl.constexpr(TINY_AMAX)  # a kernel reads a global only as a constexpr
    _NO_GELU = tl.constexpr(False)

    @triton.jit
    def _gelu_tanh(h, TO_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
        # torch's GELU(approximate="tanh") in its own order of operations (fp32); of a bf16 input rounded to bf16
        # (nearest even) as the unfused GELU writes it
        inner = 0.7978845608028654 * (h + 0.044715 * (h * h * h))
        if INTERPRETED:  # no libdevice: tanh from exp, odd by construction (tanh(10) is 1 in fp32)
            t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.abs(inner), 10.0)) + 1.0)
            t = tl.where(inner < 0, -t, t)
        else:
            t = libdevice.tanh(inner)
        g = 0.5 * h * (1.0 + t)  # pyright: ignore[reportOperatorIssue] - Triton's extern functions declare no type
        if TO_BF16:
            if INTERPRETED:  # the interpreter's conversion truncates: nearest even by bits
                bits = g.to(tl.uint32, bitcast=True)
                rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                g = tl.where(g != g, g, rounded)  # NaN stays NaN
            else:  # the GPU's conversion rounds to nearest even: 3 instructions an element fewer than the bits
                g = g.to(tl.bfloat16).to(tl.float32)
        return g

    @triton.jit
    def _load_tile(
        X, TAIL, M, K, K_HEAD, SX, ST, row0, col0, GELU: tl.constexpr, EVEN: tl.constexpr,
        INTERPRETED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # X's rows SX apart; with GELU the tile of [X | gelu(TAIL)]: columns from K_HEAD on are gelu(TAIL)'s
        rm, rk = tl.arange(0, BM), tl.arange(0, BK)
        if EVEN:  # whole tiles (every operand of Flux's): no bounds, a mask the compiler folds away; the bounds'
            # masks cost 12 of the kernel's 37 instructions an element on sm_90
            mask = (rm[:, None] < BM) & (rk[None, :] < BK)
        else:
            mask = (row0 + rm[:, None] < M) & (col0 + rk[None, :] < K)
        # 64-bit offset of the tile, 32-bit offsets within it (keeps the contiguity Triton coalesces by)
        head = X + (row0.to(tl.int64) * SX + col0) + (rm[:, None] * SX + rk[None, :])
        if GELU:
            to_bf16 = TAIL.dtype.element_ty == tl.bfloat16
            tail = TAIL + (row0.to(tl.int64) * ST + col0 - K_HEAD) + (rm[:, None] * ST + rk[None, :])
            # a tile wholly of one part reads that part alone (the tail's: the GELU on its own elements only)
            if col0 >= K_HEAD:
                x = _gelu_tanh(tl.load(tail, mask=mask, other=0.0).to(tl.float32), to_bf16, INTERPRETED)
            elif col0 + BK <= K_HEAD:
                x = tl.load(head, mask=mask, other=0.0).to(tl.float32)
            else:  # across the join (a head width no multiple of BK)
                cols = col0 + rk[None, :]
                x = tl.load(head, mask=mask & (cols < K_HEAD), other=0.0).to(tl.float32)
                h = tl.load(tail, mask=mask & (cols >= K_HEAD), other=0.0).to(tl.float32)
                x = tl.where(cols < K_HEAD, x, _gelu_tanh(h, to_bf16, INTERPRETED))
        else:
            x = tl.load(head, mask=mask, other=0.0).to(tl.float32)
        return x, mask

    @triton.jit
    def _store_tile(
        Q, QT, M, K, row0, col0, x, mask, s, FMAX: tl.constexpr, LAYOUTS: tl.constexpr, BM: tl.constexpr,
        BK: tl.constexpr,
    ):  # fmt: skip
        rm, rk = tl.arange(0, BM), tl.arange(0, BK)
        inv = tl.div_rn(1.0, s)
        # NaN stays NaN (a diverging run must show it), large values saturate
        y = tl.clamp(x * inv, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        q = y.to(Q.dtype.element_ty)
        if LAYOUTS & 1:  # x's layout
            tl.store(Q + (row0.to(tl.int64) * K + col0) + (rm[:, None] * K + rk[None, :]), q, mask=mask)
        if LAYOUTS & 2:  # the transposed one
            # the same registers at the transposed addresses: Triton stages the tile through shared memory so
            # that both stores are coalesced
            tl.store(QT + (col0.to(tl.int64) * M + row0) + (rk[None, :] * M + rm[:, None]), q, mask=mask)

    @triton.jit
    def _cast_tile(
        X, TAIL, Q, QT, SCALE, AMAX, S_OUT, SUMS, M, K, K_HEAD, SX, ST, tile_m, tile_k, FMAX: tl.constexpr,
        LAYOUTS: tl.constexpr, COLUMN_SUMS: tl.constexpr, GELU: tl.constexpr, EVEN: tl.constexpr,
        INTERPRETED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        row0, col0 = tile_m * BM, tile_k * BK
        x, mask = _load_tile(X, TAIL, M, K, K_HEAD, SX, ST, row0, col0, GELU, EVEN, INTERPRETED, BM, BK)
        # one reduction over the whole tile: rows first (axis=1) cost 15 more instructions an element on sm_90
        # (shuffles per row), a third of the kernel's, which made the cast issue-bound rather than memory-bound
        tile_amax = tl.max(tl.abs(x))
        if COLUMN_SUMS:  # this tile's column sums, one row of partials per row tile (summed in a fixed order after)
            rk = tl.arange(0, BK)
            tl.store(SUMS + tile_m * K + col0 + rk, tl.sum(x, axis=0), mask=col0 + rk < K)
        tl.atomic_max(AMAX, tile_amax)
        hist = tl.load(SCALE)
        if hist > 0:  # else the maximum only: _cast_without_history_kernel casts once it is whole
            _store_tile(Q, QT, M, K, row0, col0, x, mask, hist, FMAX, LAYOUTS, BM, BK)
            if (tile_m == 0) & (tile_k == 0):
                tl.store(S_OUT, hist)

    @triton.jit
    def _cast_transpose_kernel(
        X, TAIL, Q, QT, M, K_HEAD, SX, ST, X2, Q2, QT2, M2, K, SCALE, AMAX, S_OUT, S_OUT2, SUMS,
        FMAX: tl.constexpr, LAYOUTS: tl.constexpr, COLUMN_SUMS: tl.constexpr, GELU: tl.constexpr,
        EVEN: tl.constexpr, INTERPRETED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # the row tiles of X (or with GELU of [X | gelu(TAIL)]), then those of X2 (M2 rows, 0: none; contiguous;
        # its scale and amax follow X's, the scale it used goes to S_OUT2; column sums only for a lone X)
        tiles = tl.cdiv(M, BM)
        if tl.program_id(0) < tiles:
            _cast_tile(X, TAIL, Q, QT, SCALE, AMAX, S_OUT, SUMS, M, K, K_HEAD, SX, ST, tl.program_id(0),
                       tl.program_id(1), FMAX, LAYOUTS, COLUMN_SUMS, GELU, EVEN, INTERPRETED, BM, BK)  # fmt: skip
        else:
            _cast_tile(X2, X2, Q2, QT2, SCALE + 1, AMAX + 1, S_OUT2, SUMS, M2, K, K, K, K, tl.program_id(0) - tiles,
                       tl.program_id(1), FMAX, LAYOUTS, COLUMN_SUMS, _NO_GELU, EVEN, INTERPRETED, BM,
                       BK)  # fmt: skip

    @triton.jit
    def _cast_all_tiles(
        X, TAIL, Q, QT, SCALE, AMAX, S_OUT, M, K, K_HEAD, SX, ST, FMAX: tl.constexpr, LAYOUTS: tl.constexpr,
        GELU: tl.constexpr, EVEN: tl.constexpr, INTERPRETED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # an operand without a history, its maximum now whole in AMAX: the programs take its tiles in turn
        if tl.load(SCALE) <= 0:
            s = tl.div_rn(tl.maximum(tl.load(AMAX), _TINY_AMAX), FMAX)
            tiles_k = tl.cdiv(K, BK)
            for t in range(tl.program_id(0), tl.cdiv(M, BM) * tiles_k, tl.num_programs(0)):
                row0, col0 = (t // tiles_k) * BM, (t % tiles_k) * BK
                x, mask = _load_tile(X, TAIL, M, K, K_HEAD, SX, ST, row0, col0, GELU, EVEN, INTERPRETED, BM, BK)
                _store_tile(Q, QT, M, K, row0, col0, x, mask, s, FMAX, LAYOUTS, BM, BK)
            if tl.program_id(0) == 0:
                tl.store(S_OUT, s)

    @triton.jit
    def _cast_without_history_kernel(
        X, TAIL, Q, QT, M, K_HEAD, SX, ST, X2, Q2, QT2, M2, K, SCALE, AMAX, S_OUT, S_OUT2, FMAX: tl.constexpr,
        LAYOUTS: tl.constexpr, GELU: tl.constexpr, EVEN: tl.constexpr, INTERPRETED: tl.constexpr,
        BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # after _cast_transpose_kernel, on the same operands: the casts it left (those without a history)
        _cast_all_tiles(X, TAIL, Q, QT, SCALE, AMAX, S_OUT, M, K, K_HEAD, SX, ST, FMAX, LAYOUTS, GELU, EVEN,
                        INTERPRETED, BM, BK)  # fmt: skip
        if M2 > 0:  # a lone operand has no second scale to read
            _cast_all_tiles(X2, X2, Q2, QT2, SCALE + 1, AMAX + 1, S_OUT2, M2, K, K, K, K, FMAX, LAYOUTS, _NO_GELU,
                            EVEN, INTERPRETED, BM, BK)  # fmt: skip

    # rows x columns of x (256-byte loads, 128- and 64-byte stores per row/column), warps: measured on an H200
    # over the step's operand shapes, 1.34x the copy-rate floor without column sums and 1.7x with them (64 x 128
    # with 8 warps: 1.35x and 2.3x; 128 x 128: 1.8x; 32 x 64: 1.8x); on an H100 over a batch-4 step's operands,
    # 24 tiles: this one 1.33x, the best (128 x 64) 1.31x. All with the tile's amax reduced rows first, which cost
    # a third of the kernel's instructions: to be measured again
    _TILE = (64, 128, 4)
    # with the GELU, 4 warps (64 elements a thread) ran out of registers: 255 and 174 spills to local memory in the
    # SASS for sm_90; 8 warps hold it in 158, none
    _GELU_WARPS = 8
    # _cast_without_history_kernel takes twice the warps: its loop keeps the tile's per-element offsets live
    # across iterations (116 spills at 4 warps in its SASS, none at 8; with the GELU 38 at 16, 54 at 8: start-up only)
    _SWEEP_WARP_FACTOR = 2

    def _sweep_programs(x: torch.Tensor, tiles: int) -> int:
        """The persistent grid of _cast_without_history_kernel: two programs an SM (its launch, on the steps with
        a history, is all it costs), at most one a tile."""
        per_device = 2 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        return max(1, min(per_device, tiles))

    def _launch(
        xs: list[torch.Tensor], scale, amax, dtype, fmax: float, transpose: bool, column_sums: bool,
        rows: bool = True, gelu_tail: torch.Tensor | None = None,
    ):  # fmt: skip
        """The kernels over one operand or two of the same K (`scale`, `amax`: one element per operand). A lone
        operand's second is a zero-row tensor with outputs of its own, never the first's again: a compiled graph
        gives each tensor a kernel writes a copy of its own, and of two names for one tensor it may keep the copy
        the kernel did not write. With `gelu_tail` the first operand is [xs[0] | gelu(gelu_tail)]."""
        x, k = xs[0], xs[0].shape[1]
        tail = x if gelu_tail is None else gelu_tail
        if gelu_tail is not None:
            k += gelu_tail.shape[1]
        x2 = xs[1] if len(xs) == 2 else x.new_empty(0, k)  # no rows: the kernel takes no tile of it
        m, m2 = tail.shape[0], x2.shape[0]
        qs = [torch.empty((t, k) if rows else (0,), device=x.device, dtype=dtype) for t in (m, m2)]
        qts = [torch.empty((k, t) if transpose else (0,), device=x.device, dtype=dtype) for t in (m, m2)]
        # one scale per operand (torch._scaled_mm takes no scale at an offset into a larger tensor), allocated with a
        # dimension and returned as a 0-dim view: Inductor fills a 0-dim empty with a kernel of its own (2 launches
        # per cast, measured)
        ss = [torch.empty(1, device=x.device, dtype=torch.float32) for _ in (x, x2)]
        bm, bk, warps = _TILE
        warps = warps if gelu_tail is None else _GELU_WARPS
        partial = torch.empty((triton.cdiv(m, bm), k) if column_sums else (0,), device=x.device, dtype=torch.float32)
        row_tiles, col_tiles = triton.cdiv(m, bm) + triton.cdiv(m2, bm), triton.cdiv(k, bk)
        operands = (x, tail, qs[0], qts[0], m, x.shape[1], max(x.stride(0), 1), tail.stride(0))  # an empty head's
        operands += (x2, qs[1], qts[1], m2, k, scale, amax, ss[0], ss[1])
        layout = dict(
            FMAX=fmax,
            LAYOUTS=int(rows) | 2 * int(transpose),
            GELU=gelu_tail is not None,
            EVEN=m % bm == 0 and m2 % bm == 0 and k % bk == 0,
            INTERPRETED=interpreted(),
            BM=bm,
            BK=bk,
        )
        wrap_triton(_cast_transpose_kernel)[(row_tiles, col_tiles)](
            *operands, partial, COLUMN_SUMS=column_sums, num_warps=warps, **layout
        )
        programs = _sweep_programs(x, row_tiles * col_tiles)
        wrap_triton(_cast_without_history_kernel)[(programs,)](
            *operands, num_warps=warps * _SWEEP_WARP_FACTOR, **layout
        )
        return qs[: len(xs)], qts[: len(xs)], [s.view(()) for s in ss[: len(xs)]], partial

    @triton_op("flux_train::fp8_cast_transpose", mutates_args={"amax"})
    def _cast_transpose_triton(
        x: torch.Tensor,
        scale: torch.Tensor,
        amax: torch.Tensor,
        dtype: torch.dtype,
        fmax: float,
        transpose: bool,
        column_sums: bool,
        rows: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`dtype` the values' type (e4m3; the tests take fp32 values under the interpreter, whose e4m3
        conversion is not faithful), `fmax` the e4m3 format's largest value."""
        (q,), (qt,), (s,), partial = _launch([x], scale, amax, dtype, fmax, transpose, column_sums, rows)
        return q, qt, s, partial.sum(0) if column_sums else partial

    @triton_op("flux_train::fp8_cast_transpose_pair", mutates_args={"amax"})
    def _cast_transpose_pair_triton(
        x: torch.Tensor,
        w: torch.Tensor,
        scales: torch.Tensor,
        amax: torch.Tensor,
        dtype: torch.dtype,
        fmax: float,
        gelu_tail: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The two operands of one GEMM (the same K) in the same launches: `scales`, `amax` [2]; with `gelu_tail`
        the first is [x | gelu(gelu_tail)]."""
        (xq, wq), (xq_t, wq_t), (xs, ws), _ = _launch(
            [x, w], scales, amax, dtype, fmax, True, False, gelu_tail=gelu_tail
        )
        return xq, xq_t, xs, wq, wq_t, ws


def _on_triton(x: torch.Tensor, impl: str) -> bool:
    """Whether the Triton kernels cast x (`impl`: see cast_transpose), else torch ops. `auto` casts fp32 operands
    (train.compute_dtype=float32: the debug model) in torch ops: on an H100 the kernel's transposed output of fp32
    operands came out wrong (an all-zero fp32 [256, 64] tensor's transpose held non-zero bytes; e4m3 NaNs in the
    debug model's step-1 weight gradients), while bf16 operands of every shape match torch bit for bit
    (tests/gpu/test_gpu.py)."""
    if not (impl == "triton" or (impl == "auto" and HAVE_TRITON and x.is_cuda and x.dtype != torch.float32)):
        return False
    if not kernels_run_on(x.device):
        raise RuntimeError("the Triton FP8 cast needs a GPU (or Triton's interpreter on the CPU)")
    return True


def cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    transpose: bool = True,
    column_sums: bool = False,
    impl: str = "auto",
    rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 x (empty unless `rows`), e4m3 x transposed (row-major; empty unless `transpose`), the scale used, x's
    fp32 column sums (empty unless `column_sums`)) for a 2-D x; `amax` (1-element fp32) is raised to |x|'s maximum.
    `impl`: auto (Triton on a GPU, torch elsewhere), triton (also on the CPU under Triton's interpreter: the tests),
    torch."""
    if _on_triton(x, impl):
        fmax = torch.finfo(dtype).max
        return _cast_transpose_triton(x.contiguous(), scale, amax, dtype, fmax, transpose, column_sums, rows)
    return cast_transpose_torch(x, scale, amax, dtype, transpose, column_sums, rows)


def gelu_tanh_joined(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """[head | gelu(tail)] along the last dim, GELU as the reference's (tanh approximation): the input of an MLP's
    output projection (head with no columns) or of a single block's linear2 (head: the attention's output)."""
    return torch.cat((head, torch.nn.functional.gelu(tail, approximate="tanh")), dim=-1)


def cast_transpose_pair(
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    impl: str = "auto",
    gelu_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cast_transpose` of a GEMM's two operands x [M,K] and w [N,K] in the same launches (each launch costs
    microseconds in a step of a few hundred): (xq, xq transposed, x's scale used, wq, wq transposed, w's scale
    used); `scales` and `amax` [2] hold x's and then w's. With `gelu_tail` [M,K-Kx] the first operand is
    gelu_tanh_joined(x, gelu_tail), computed as the kernel reads its parts (the joined bf16 tensor is never
    written); the tail may be a view whose rows are apart."""
    k = x.shape[1] + (0 if gelu_tail is None else gelu_tail.shape[1])
    if k != w.shape[1]:
        raise ValueError(f"cast_transpose_pair: x ({k} columns) and w {tuple(w.shape)} differ in K")
    if _on_triton(x if gelu_tail is None else gelu_tail, impl):
        tail = gelu_tail if gelu_tail is None or gelu_tail.stride(1) == 1 else gelu_tail.contiguous()
        return _cast_transpose_pair_triton(
            x.contiguous(), w.contiguous(), scales.contiguous(), amax, dtype, torch.finfo(dtype).max, tail
        )
    x = x if gelu_tail is None else gelu_tanh_joined(x, gelu_tail)
    xq, xq_t, xs, _ = cast_transpose_torch(x, scales[0], amax[0:1], dtype)
    wq, wq_t, ws, _ = cast_transpose_torch(w, scales[1], amax[1:2], dtype)
    return xq, xq_t, xs, wq, wq_t, ws
