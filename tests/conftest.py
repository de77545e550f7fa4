"""The suite by level (tests/support/levels.py): tests/unit, tests/runs, tests/cluster, tests/gpu, each folder's
conftest.py marking its tests; the helpers of every level in tests/support/, importable by name from any of them
(`from run_outputs import train`)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(SUPPORT))
os.chdir(ROOT)  # configs/ paths in tests are relative to the repository root

import torch  # noqa: E402
from levels import disagreements  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run in Triton's CPU interpreter (tests/unit/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """A test's markers agree with its place, or nothing runs; GPU tests skip without a GPU."""
    tests = Path(__file__).resolve().parent
    found = disagreements(
        (item.nodeid, item.path.resolve().relative_to(tests).parts, {m.name for m in item.iter_markers()})
        for item in items
        if item.path.resolve().is_relative_to(tests)
    )
    if found:
        raise pytest.UsageError("markers and places disagree (tests/support/levels.py):\n" + "\n".join(found))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random VAE/T5/CLIP folders (tests/support/tiny_models.py)."""
    from tiny_models import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("models"))
