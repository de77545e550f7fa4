"""The planner's inputs: what is known about one GPU kind (`Figures`): figures stated by flags (a bandwidth from the
pre-flight probe, a published training rate), flux_train/tools/measured.yaml (figures and bench rows per GPU kind, each
with the command and date that produced it), the vendor's figures in flux_train/hardware.py (the memory), a bench rows
file (--measured, used ahead of the table); the configuration a bench row measured; the MLPerf reference convergence
points that mlperf-logging ships."""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace
from pathlib import Path

import yaml

from flux_train.config import Config
from flux_train.errors import UserError
from flux_train.hardware import Kind, kind_of, named
from flux_train.outputs.mllog import BENCHMARK, RULESET, USAGE, rcp_samples
from flux_train.precision_recipes import labelled
from flux_train.private_apis import rcp_batch_sizes
from flux_train.tools.bench_table import fp8_impl_of, read_rows

FIGURES_FILE = Path(__file__).with_name("measured.yaml")


class PlanError(UserError):
    """A plan that cannot be made (no RCP for the GBS, no GPU kind) or a run that cannot fit its GPUs."""

    label = "plan"


class Figures:
    """What is known about one GPU kind: stated figures (flags) first, then the measured figures, then the vendor's
    (flux_train/hardware.py: its memory); bench rows from a --measured file first, then the table's. Activations may
    come from another kind's rows (the same code and model hold the same tensors), labelled so."""

    def __init__(self, kind: str, measured: str | None = None, stated: dict | None = None):
        table = yaml.safe_load(FIGURES_FILE.read_text())
        found = kind_of(kind)
        self.kind = found.name if found else kind
        self.known = found is not None
        self.figures = table.get(self.kind, {}).get("figures", {})
        self.vendor = vendor_figures(found)
        self.stated = {k: v for k, v in (stated or {}).items() if v is not None}
        self.row_sets = [  # this kind's rows, then the other kinds'; stock steps are the table's baselines only
            [(r, f"{FIGURES_FILE.name} {k}, {r['date']}") for k, v in table.items() if (k == self.kind) == mine
             for r in v.get("rows", []) if not (r["mode"] == "step" and r["row"] == "stock")]
            for mine in (True, False)
        ]  # fmt: skip
        if measured:
            self.row_sets.insert(0, self._read(measured))

    def _read(self, path: str) -> list[tuple[dict, str]]:
        rows = []
        for n, row in enumerate(read_rows(path, "--measured"), 1):
            if "error" in row or not (row["row"] == "ours" or "-fp8-" in row["row"]):
                continue  # failed rows, stock diffusers and the ablations measure other code
            if "blocks" not in row or (row["mode"] == "step" and "strategy" not in row):
                raise PlanError(
                    f"--measured {path}: row {n} has no 'blocks' or 'strategy' (written by an older bench): add "
                    '"blocks": [double, single] and, for a step row, "strategy"'
                )
            if not named(self.kind, row.get("device", self.kind)):
                raise PlanError(
                    f"--measured {path}: row {n} was measured on {row['device']}, the plan is for {self.kind}"
                )
            rows.append((row, f"{path} row {n}"))
        return rows

    @property
    def measured(self) -> bool:
        """Whether anything of this kind was measured or stated: a figure not from the vendor's spec, a bench row."""
        return bool(self.stated) or bool(self.figures) or any(self.row_sets[:-1])

    def figure(self, name: str) -> tuple[float, str] | None:
        """(value, where it comes from) of a stated, measured or vendor's figure, or None."""
        if name in self.stated:
            return float(self.stated[name]), f"{self.stated[name]:g}, stated on the command line"
        f = self.figures.get(name)
        if f is None:
            return self.vendor.get(name)
        span = f"{f['value']:g}-{f['high']:g}" if "high" in f else f"{f['value']:g}"
        return float(f["value"]), f"{span} {f['unit']} ({self.kind}, measured {f['date']})"

    def rows(self, mode: str, match, any_kind: bool = False) -> tuple[list[dict], str]:
        """The matching rows of the first row set that has any (this kind's, then with any_kind another's)."""
        for rows in self.row_sets[: None if any_kind else -1]:
            found = [(r, where) for r, where in rows if r["mode"] == mode and match(r)]
            if found:
                return [r for r, _ in found], "; ".join(dict.fromkeys(where for _, where in found))
        return [], ""

    def excluding(self, setup: tuple) -> Figures:
        """These figures without the step rows of one configuration (to check a projection against them)."""
        other = copy.copy(self)
        other.row_sets = [[(r, w) for r, w in rows if step_setup(r) != setup] for rows in self.row_sets]
        return other


def vendor_figures(kind: Kind | None) -> dict[str, tuple[float, str]]:
    """A kind's figures from flux_train/hardware.py, as the plan shows them: (value, where it comes from)."""
    if kind is None:
        return {}
    return {"memory_gib": (kind.memory_gib, f"{kind.memory_gib:g} GiB ({kind.name}, spec: {kind.memory_spec})")}


def step_setup(row: dict) -> tuple | None:
    """What a step row measured, as one key: depth, GPUs, micro-batch, accumulation, layout, activation
    checkpointing, precision, whose FP8, graphs (None: not recorded)."""
    if row["mode"] != "step":
        return None
    return (
        tuple(row["blocks"]), row["world"], row["batch"], row["accum"], row["strategy"], checkpointed(row),
        row["precision"], fp8_impl_of(row), row.get("graphs"),
    )  # fmt: skip


def checkpointed(row: dict) -> bool:
    """Whether a bench row's blocks were checkpointed (rows from before the bench recorded it were not)."""
    return row.get("activation_checkpointing", False)


def row_config(cfg: Config, row: dict) -> Config:
    """The config a bench row measured: the planned model's width at the row's depth, one node of its GPUs, its
    micro-batch, accumulation, layout, activation checkpointing and precision."""
    c = copy.deepcopy(cfg)
    c.model.num_layers, c.model.num_single_layers = row["blocks"]
    c.train.compute_dtype = "bfloat16"
    c.train.micro_batch_size = row["batch"]
    c.train.global_batch_size = row["batch"] * row.get("world", 1) * row.get("accum", 1)
    c.parallel.strategy = row.get("strategy", c.parallel.strategy)
    c.parallel.dp_shard = c.parallel.dp_replicate = -1
    c.parallel.activation_checkpointing = checkpointed(row)
    c.perf = replace(c.perf, fp8=labelled(row["precision"]).name, fp8_impl=fp8_impl_of(row) or c.perf.fp8_impl)
    c.slurm.nodes, c.slurm.gpus_per_node = 1, row.get("world", 1)
    return c


def rcp_points(gbs: int) -> dict:
    """Samples to converge at this GBS in the MLPerf reference runs (mlperf-logging's RCP table): mean, range."""
    samples = rcp_samples(gbs)
    if not samples:
        sizes = ", ".join(map(str, rcp_batch_sizes(USAGE, RULESET, BENCHMARK)))
        raise PlanError(
            f"GBS {gbs} has no reference convergence point: the {BENCHMARK} RCPs ({USAGE} {RULESET}) measured "
            f"samples to converge at GBS {sizes} only, so no time-to-train can be projected for {gbs}; choose one "
            "of them (configs/recipes/gbs<N>.yaml)"
        )
    return {
        "gbs": gbs,
        "rcp": f"{USAGE} {RULESET}",
        "runs": len(samples),
        "mean": statistics.fmean(samples),
        "low": min(samples),
        "high": max(samples),
    }
