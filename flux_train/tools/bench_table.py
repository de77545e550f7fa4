"""The GPU-free half of the bench: rows read back, the table printed (ratios to the stock row of the same call,
step efficiency, profiles), the kernels of a profile summed by kind. `python -m flux_train.bench --table FILE`
runs it on any host; flux_train.tools.bench measures the rows on GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from flux_train.config import Config
from flux_train.errors import UserError
from flux_train.precision_recipes import RECIPES, fp8_row

# first match wins: attention kernels carry cutlass in their names, our AdamW kernel "adamw"; inductor names a
# kernel after the ops it fused, so its dtype casts (FP8 ones included) say `_to_copy` and count with the copies,
# while "fp8 casts" are the kernels that name amax or the FP8 types
KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa")),
    ("optimizer + clip", ("adamw", "adam", "multi_tensor", "foreach", "norm_kernel", "reduce_kernel", "lerp")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")),
    ("fp8 casts", ("amax", "float8", "fp8", "cast_transpose")),
    ("copies, dtype casts", ("chunk_cat", "split_with_sizes", "copy", "catarray")),
    ("elementwise (triton)", ("triton",)),
)


def kernel_breakdown(kernels: list[tuple[str, float, float]], wall_ms: float, steps: int, top: int = 25):
    """From the CUDA kernels of `steps` profiled steps ((name, start us, end us)) and the profiled wall time per
    step: ms per step of kernel time by kind (KERNEL_KINDS + other), the compute stream's busy and idle time (the
    step minus the union of non-NCCL kernels: exposed communication and CPU stalls), and of that idle time what
    lies between two kernels and how much of it with a collective running; the `top` kernels by time, [name, kind,
    ms per step, launches per step], to say which kernel a kind's time is; and the idle gaps grouped by what ended
    them, [ms per step, gaps per step, the kernel that started after the gap, the collective that ran longest in
    it or ""], the largest first: what the compute stream waited for."""
    per_kernel: dict[str, list] = {}  # name -> [kind, ms, launches]
    spans, collectives = [], []
    for name, start, end in kernels:
        if name not in per_kernel:
            lower = name.lower()
            kind = next((k for k, keys in KERNEL_KINDS if any(s in lower for s in keys)), "other")
            per_kernel[name] = [kind, 0.0, 0]
        entry = per_kernel[name]
        entry[1] += (end - start) / 1000
        entry[2] += 1
        (collectives if entry[0] == "nccl" else spans).append((start, end, name))
    busy, last, gaps = 0.0, None, []  # gaps: (start, end, the kernel after)
    for s, e, name in sorted(spans):
        if last is not None and s > last:
            gaps.append((last, s, name))
        if last is None or s > last:
            busy, last = busy + (e - s), e
        elif e > last:
            busy, last = busy + (e - last), e
    by_kind = {k: 0.0 for k, _ in KERNEL_KINDS} | {"other": 0.0}
    for kind, ms, _ in per_kernel.values():
        by_kind[kind] += ms
    out = {k: round(v / steps, 1) for k, v in by_kind.items()}
    out["compute busy"] = round(busy / 1000 / steps, 1)
    out["compute idle"] = round(wall_ms - busy / 1000 / steps, 1)
    waits, between, under_nccl = _idle_gaps(gaps, sorted(collectives))
    out["idle between kernels"] = round(between / 1000 / steps, 1)
    out["idle, a collective running"] = round(under_nccl / 1000 / steps, 1)
    out["step (profiled)"] = round(wall_ms, 1)
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    kernels_top = [[name[:120], kind, round(ms / steps, 2), count // steps] for name, (kind, ms, count) in ranked]
    grouped = sorted(waits.items(), key=lambda kv: -kv[1][0])[:top]
    idle = [
        [round(us / 1000 / steps, 2), round(n / steps, 1), after[:90], nccl[:60]] for (after, nccl), (us, n) in grouped
    ]
    return out, kernels_top, idle


def _idle_gaps(gaps: list[tuple], collectives: list[tuple]) -> tuple[dict, float, float]:
    """The compute stream's gaps against the collectives' kernels (both sorted by start): ({(the kernel after the
    gap, the collective most inside it): [us, gaps]}, the gaps' us, their us with a collective running)."""
    waits: dict[tuple, list] = {}
    between = under = 0.0
    first = 0  # the collectives before it ended before this gap, and so before every later one
    for g0, g1, after in gaps:
        while first < len(collectives) and collectives[first][1] <= g0:
            first += 1
        covered, reach, most = 0.0, g0, ("", 0.0)
        for c0, c1, name in collectives[first:]:
            if c0 >= g1:
                break
            lo, hi = max(c0, g0), min(c1, g1)
            if hi > lo:
                covered += max(0.0, hi - max(lo, reach))  # the union: overlapping collectives count once
                reach = max(reach, hi)
                most = max(most, (name, hi - lo), key=lambda m: m[1])
        entry = waits.setdefault((after, most[0]), [0.0, 0])
        entry[0] += g1 - g0
        entry[1] += 1
        between += g1 - g0
        under += covered
    return waits, between, under


def fp8_impl_of(row: dict) -> Literal["ours", "torchao"] | None:
    """Whose FP8 kernels a bench row measured: None for bf16, else "ours" or "torchao" (the row's fp8_impl; rows
    written before the bench recorded it: torchao when named for it)."""
    if row.get("precision", "bf16") == "bf16":
        return None
    return "torchao" if row.get("fp8_impl") == "torchao" or row["row"].startswith("torchao") else "ours"


def precision_of(row: str, cfg: Config) -> str:
    """The precision column of a bench row: its recipe's label (stock rows: bf16; ours: the config's recipe)."""
    fp8 = fp8_row(row)
    recipe = fp8[1] if fp8 else RECIPES["none" if row.startswith("stock") else cfg.perf.fp8]
    return recipe.label


def _stock_for(r: dict, rows: list[dict]) -> dict | None:
    """The stock row `r`'s ratio is taken against: same mode, batch and blocks."""
    return next(
        (
            s
            for s in rows
            if s["mode"] == r["mode"]
            and s["row"] == "stock"
            and s["batch"] == r["batch"]
            and s.get("blocks") == r.get("blocks")
            and "error" not in s
        ),
        None,
    )


def _fwdbwd_for(r: dict, rows: list[dict]) -> dict | None:
    """The fwdbwd row of ours a step row's efficiency is taken against: same precision, batch and blocks."""
    return next(
        (
            s
            for s in rows
            if s["mode"] == "fwdbwd"
            and s["row"].startswith("ours")
            and s["row"] not in ("ours-no-graphs", "ours-no-compile", "ours-torch-rmsnorm")
            and s.get("precision") == r.get("precision")
            and s["batch"] == r["batch"]
            and s.get("blocks") == r.get("blocks")
            and "error" not in s
        ),
        None,
    )


def _print_throughput(rows: list[dict]) -> None:
    """The fwdbwd and step rows, one line each: throughput, MFU, memory, ratio to stock, step efficiency."""
    print(
        f"\n{'mode':6s} {'row':58s} {'batch':>5s} {'samples/s/GPU':>13s} {'MFU %':>6s} {'peak GiB':>8s} "
        f"{'vs stock':>8s} {'step eff':>8s} {'eval/s/GPU':>10s}"
    )
    for r in rows:
        name = r.get("label", r["row"]) + (f" [{r['precision']}]" if "precision" in r else "")
        name += f" {r['attention']}" if r.get("attention") and not r["row"].startswith("stock") else ""
        if "error" in r:
            print(f"{r['mode']:6s} {name:58s} {r['batch']:5d} {r['error']}")
            continue
        stock, ref = _stock_for(r, rows), _fwdbwd_for(r, rows) if r["mode"] == "step" else None
        ratio = f"{r['samples_s_per_gpu'] / stock['samples_s_per_gpu']:.2f}x" if stock else "-"
        eff = f"{r['samples_s_per_gpu'] / ref['samples_s_per_gpu']:.2f}" if ref else "-"
        mfu = 100 * r["samples_s_per_gpu"] * r["flops_per_sample"] / 1e12 / r["ceiling_tflops"]
        print(
            f"{r['mode']:6s} {name:58s} {r['batch']:5d} {r['samples_s_per_gpu']:13.2f} {mfu:6.1f} "
            f"{r['peak_gib']:8.1f} {ratio:>8s} {eff:>8s} {r.get('eval_samples_s_per_gpu', '-'):>10}"
        )
        if "fp8_startup" in r:  # run before the timed steps, which are the steady ones (bench.settle_fp8)
            startup = r["fp8_startup"]
            print(
                f"       FP8 start-up: {startup['steps']} steps until every operand had an amax history, "
                f"{startup['extra_s']} s beyond as many steady steps"
            )


def _print_casts(casts: list[dict]) -> None:
    for r in casts:
        print(
            f"\nFP8 casts alone, {r['row']}, batch {r['batch']}: {r['ms']} ms per forward+backward, byte floor "
            f"{r['floor_ms']} ms at {r['copy_tb_s']} TB/s ({r['ms'] / r['floor_ms']:.2f}x)"
        )
        for m, k, count, us, gbps in r["shapes"]:
            print(f"  {m:6d} x {k:6d} x{count:4d}: {us:8.1f} us {gbps:6d} GB/s")
        if "gelu" in r:
            print("  with a GELU, x and W cast together: applied by the cast, or written in bf16 first (Inductor)")
            for m, head, tail, count, fused, apart in r["gelu"]:
                print(f"  {m:6d} x {head:5d}+{tail:5d} x{count:4d}: {fused:8.1f} us in the cast {apart:8.1f} us apart")


def _print_collectives(collectives: list[dict]) -> None:
    for r in collectives:
        print(f"\n{r['row']} over {r['world']} GPUs: bus bandwidth {r['busbw_gbps']} GB/s (mean of the sizes)")
        for what, mb, ms, gbps in r["sizes"]:
            print(f"  {what:26s} {mb:7d} MB {ms:9.3f} ms {gbps:7.1f} GB/s")


def _print_profiles(profiled: list[dict]) -> None:
    """GPU time per kernel kind, a column per profiled row, then each row's top kernels."""
    if not profiled:
        return
    kinds = list(profiled[0]["profile"])
    print("\nGPU time per step (ms), by kernel kind; idle = step - compute-stream busy")
    print(
        f"{'kind':28s}"
        + "".join(f" {(r.get('label', r['row']) + ' ' + r.get('precision', ''))[:22]:>23s}" for r in profiled)
    )
    for kind in kinds:
        print(f"{kind:28s}" + "".join(f" {r['profile'].get(kind, 0):23.1f}" for r in profiled))
    for r in profiled:
        print(f"\ntop kernels, {r.get('label', r['row'])} {r.get('precision', '')}: ms/step launches/step kind name")
        for name, kind, ms, count in r.get("top_kernels", []):
            print(f"  {ms:9.2f} {count:6d} {kind[:12]:12s} {name[:90]}")
        if r.get("idle_gaps"):
            print(f"idle gaps, {r.get('label', r['row'])}: ms/step gaps/step, the kernel after, the collective in it")
            for ms, count, after, nccl in r["idle_gaps"][:10]:
                print(f"  {ms:9.2f} {count:6.1f} {after[:60]:60s} {nccl[:40]}")


def print_table(rows: list[dict]) -> None:
    """Rows of one or more bench runs: throughput, ratios to stock, step efficiency, casts, collectives, profiles."""
    timed = [r for r in rows if r["mode"] not in ("casts", "collectives")]
    _print_throughput(timed)
    _print_casts([r for r in rows if r["mode"] == "casts"])
    _print_collectives([r for r in rows if r["mode"] == "collectives"])
    _print_profiles([r for r in timed if "profile" in r])


def read_rows(path: str, flag: str = "--table") -> list[dict]:
    """The rows of a --json file (for --table, and the planner's --measured)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UserError(f"{flag} {path}: {exc.strerror}; give a file that --json wrote") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not (isinstance(row, dict) and {"mode", "row"} <= row.keys()):
            raise UserError(f"{flag} {path}: line {n} is not a bench row; give a file that --json wrote")
        rows.append(row)
    return rows
