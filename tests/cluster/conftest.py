"""tests/cluster: Slurm, containers, the launcher and submit paths. Every test here is marked `cluster`; those on
a real Slurm also `slurm` (and `slow`), and the container engine and the two-node Slurm are fixtures of this level
only."""

import pytest
from containers import engine  # noqa: F401  podman or apptainer, ready for the launcher tests
from slurm_cluster import slurm_cluster  # noqa: F401  the real two-node Slurm for tests/cluster/test_slurm_submit.py


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.cluster)
