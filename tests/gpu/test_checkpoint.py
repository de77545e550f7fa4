"""Checkpoints on a GPU: async saves staged through pinned host buffers (the CPU's checkpoint tests:
tests/runs/test_checkpoint.py)."""

import pytest

from tests.runs.test_checkpoint import async_checkpoints_complete_and_resume_exactly


@pytest.mark.slow  # it trains
def test_async_checkpoints_complete_and_resume_exactly(tmp_path):
    async_checkpoints_complete_and_resume_exactly(tmp_path, "cuda")
