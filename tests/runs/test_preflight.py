"""Pre-flight through the trainer: a missing dataset is named with the host and nothing starts; a fit node passes
and trains (the node checks: tests/unit/test_preflight.py)."""

import socket

import pytest
from run_outputs import train as run_train


def train(out, *extra):
    return run_train(
        out,
        "--set",
        "preflight.enabled=true",
        "--set",
        "train.max_steps=2",
        "--set",
        "eval.enabled=false",
        *extra,
        timeout=300,
    )


@pytest.mark.slow
def test_missing_dataset_is_named_with_the_host_and_nothing_starts(tmp_path):
    proc = train(tmp_path / "run", "--set", "data.source=energon", "--set", f"data.path={tmp_path / 'no-such-data'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pre-flight: {socket.gethostname()}: dataset ") and "not readable" in line
    assert f"--exclude {socket.gethostname()}" in line
    mllog = tmp_path / "run" / "mllog.log"
    assert not mllog.exists() or "init_start" not in mllog.read_text()


@pytest.mark.slow
def test_a_fit_node_passes_and_trains(tmp_path):
    proc = train(tmp_path / "run", "--set", "data.source=synthetic")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the step cap train.max_steps 2" in proc.stdout  # not pre-flight
