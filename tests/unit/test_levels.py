"""The suite's levels (tests/support/levels.py): the check that refuses a collection where a test's markers and its
place disagree, tried on planted tests; the real suite passes it at every collection (the root conftest.py)."""

import pytest
from levels import disagreements


def check(path: str, *markers: str) -> list[str]:
    return disagreements([("t", tuple(path.split("/")), set(markers))])


def test_a_test_in_its_levels_folder_with_its_markers_passes():
    assert check("unit/test_x.py", "unit") == []
    assert check("runs/test_x.py", "runs", "slow") == []
    assert check("cluster/test_x.py", "cluster", "slurm", "slow") == []
    assert check("gpu/test_x.py", "gpu", "slow") == []
    assert check("unit/test_x.py", "unit", "parametrize") == []  # markers that say nothing of a level are free


@pytest.mark.parametrize(
    "path,markers,said",
    [
        ("test_x.py", ["unit"], "not in a level's folder"),
        ("support/test_x.py", ["unit"], "not in a level's folder"),
        ("unit/test_x.py", [], "without the unit marker"),
        ("unit/test_x.py", ["unit", "runs"], "marked runs"),
        (
            "unit/test_x.py",
            ["unit", "slow"],
            "marked slow, which belongs in tests/runs/ or tests/cluster/ or tests/gpu/",
        ),
        ("runs/test_x.py", ["runs", "slurm", "slow"], "marked slurm, which belongs in tests/cluster/"),
        ("runs/test_x.py", ["runs", "gpu", "slow"], "marked gpu, which belongs in tests/gpu/"),
        ("runs/test_x.py", ["runs"], "without the slow marker"),
    ],
)
def test_a_marker_out_of_place_is_named(path, markers, said):
    found = check(path, *markers)
    assert len(found) == 1 and said in found[0], found
