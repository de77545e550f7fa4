"""The suite's levels: each a folder of tests/ and a marker of the same name, which the folder's conftest.py gives
every test in it. The root conftest.py refuses a collection where a test's markers and its place disagree
(`disagreements`): its level marker is its folder's, and the markers that say what a test needs are only where that
level allows them (no slow test in tests/unit, Slurm only in tests/cluster, a GPU only in tests/gpu)."""

from __future__ import annotations

from collections.abc import Iterable

LEVELS = {
    "unit": "fast: no training run, no compile over a few seconds, no Slurm or containers (the quick loop)",
    "runs": "training runs, dataprep pipelines end to end, compiles: anything slow",
    "cluster": "Slurm, containers, the launcher and submit paths",
    "gpu": "needs a CUDA/ROCm GPU (skipped without one; bash tests/gpu_check.sh tests runs them on a GPU host)",
}
# what a test needs, and the levels whose tests may say so
NEEDS = {
    "slow": {"runs", "cluster", "gpu"},  # takes more than a few seconds on the CI machine
    "slurm": {"cluster"},  # slurmctld/slurmd from Debian's packages
    "gpu": {"gpu"},
}
ALWAYS = {"runs": {"slow"}}  # every test of tests/runs is slow


def level_of(parts: tuple[str, ...]) -> str | None:
    """The level of a test file from its path's parts under tests/ ("unit", "test_x.py"): its first folder."""
    return parts[0] if len(parts) > 1 and parts[0] in LEVELS else None


def disagreements(tests: Iterable[tuple[str, tuple[str, ...], set[str]]]) -> list[str]:
    """For each test (its id, its file's path parts under tests/, the names of its markers), what disagrees
    between its place and its markers: one line each."""
    found = []
    for name, parts, markers in tests:
        level = level_of(parts)
        if level is None:
            found.append(f"{name}: not in a level's folder (tests/{{{','.join(LEVELS)}}}/)")
            continue
        carried = sorted(markers & LEVELS.keys() - {level} - NEEDS.keys())  # gpu is both: a need, below
        if level not in markers:
            found.append(f"{name}: in tests/{level}/ without the {level} marker (tests/{level}/conftest.py gives it)")
        if carried:
            found.append(f"{name}: in tests/{level}/ but marked {', '.join(carried)}")
        for need in sorted(markers & NEEDS.keys()):
            if level not in NEEDS[need]:
                where = " or ".join(f"tests/{lv}/" for lv in LEVELS if lv in NEEDS[need])
                found.append(f"{name}: marked {need}, which belongs in {where}, not tests/{level}/")
        for need in sorted(ALWAYS.get(level, set()) - markers):
            found.append(f"{name}: in tests/{level}/ without the {need} marker")
    return found
