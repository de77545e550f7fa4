import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)  # configs/ paths in tests are relative to the repository root

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run in Triton's CPU interpreter (tests/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from containers import engine  # noqa: E402,F401  podman or apptainer, ready for the launcher tests
from slurm_cluster import slurm_cluster  # noqa: E402,F401  the real two-node Slurm for tests/test_slurm_*.py


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random VAE/T5/CLIP folders (tests/tiny_models.py)."""
    from tiny_models import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("models"))
