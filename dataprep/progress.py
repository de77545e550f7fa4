"""Progress bars (rate and ETA) and end-of-run summaries, the same for every subcommand."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm import tqdm


def bar(total, desc: str, unit: str = "sample", initial: int = 0, iterable=None) -> tqdm:
    return tqdm(
        iterable,
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        dynamic_ncols=True,
        smoothing=0.05,
        file=sys.stderr,
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def summary(title: str, rows: Sequence[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"== {title}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    sys.stdout.flush()


def listed(items: list, limit: int = 20) -> str:
    """The first `limit` items, one per line, for a summary."""
    shown = "\n".join(f"    {item}" for item in items[:limit])
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return shown + more


def skipped(rows: list, full_list) -> str:
    """Summary value for skipped inputs ([row, key, reason] each): the count, then the first ones."""
    if not rows:
        return "0"
    return f"{len(rows)} (all listed in {full_list})\n" + listed([f"row {r} {k!r}: {why}" for r, k, why in rows])
