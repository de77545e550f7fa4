"""tests/runs: training runs, dataprep pipelines end to end, compiles: anything slow. Every test here is marked
`runs` and `slow`."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.runs)
    item.add_marker(pytest.mark.slow)
