"""The precision recipes `perf.fp8` names, in one table that everything reading a recipe takes it from: the config's
checks, the FP8 layers (flux_train/kernels/fp8.py), the trainer's precision component
(flux_train/training/precision.py), the bench's rows and tables and the planner. No torch here: the command-line
parsers read it too."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    name: str  # perf.fp8
    impls: tuple[str, ...]  # the perf.fp8_impl values that run it
    history: bool  # scales from an amax history of earlier steps (delayed scaling): checkpointed, settles in
    per_row: bool  # one scale per row of each operand (else one per tensor)
    # the impls whose layers can keep each FP8 weight's e4m3 copy from forward to backward (ours do under ddp; under
    # fsdp, which gathers the weights again for the backward, they cast them again: FP8Linear.recast_weight)
    e4m3_weights: tuple[str, ...]
    label: str  # the precision column of bench rows and tables

    @property
    def fp8(self) -> bool:
        return self.name != "none"


RECIPES = {
    r.name: r
    for r in (
        Recipe("none", ("ours", "torchao"), history=False, per_row=False, e4m3_weights=(), label="bf16"),
        Recipe("delayed", ("ours",), history=True, per_row=False, e4m3_weights=("ours",), label="fp8 delayed"),
        Recipe("tensorwise", ("ours", "torchao"), history=False, per_row=False, e4m3_weights=("ours",), label="fp8 tensorwise"),
        Recipe("rowwise", ("ours", "torchao"), history=False, per_row=True, e4m3_weights=(), label="fp8 rowwise"),
    )
}  # fmt: skip


def labelled(label: str) -> Recipe:
    """The recipe of a bench row's precision column."""
    return next(r for r in RECIPES.values() if r.label == label)


def fp8_row(row: str) -> tuple[str, Recipe] | None:
    """(impl, recipe) of a bench row named `<impl>-fp8-<recipe>`, else None."""
    impl, found, name = row.partition("-fp8-")
    return (impl, RECIPES[name]) if found else None


def fp8_rows(impl: str, per_row: bool | None = None) -> tuple[str, ...]:
    """The bench rows `<impl>-fp8-<recipe>` of every FP8 recipe `impl` runs (with `per_row`: only those scaled so)."""
    return tuple(
        f"{impl}-fp8-{r.name}" for r in RECIPES.values() if r.fp8 and impl in r.impls and per_row in (None, r.per_row)
    )
