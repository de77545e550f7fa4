"""The check each node runs before its container starts (flux_train/cluster/container.py): one line naming the node and
the fix for an engine that is missing, an image that is not there, a mount source that is not there, an rlimit
the engine cannot set and a container that does not start, against the real podman (tests/support/containers.py); and
config strings staying inert in it, with a stand-in engine that records what it is asked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flux_train.cluster import container
from flux_train.config import load_config

SYSTEM = "configs/systems/cpu_02x02.yaml"
PODMAN = pytest.mark.parametrize("engine", ["podman"], indirect=True)


def check(engine, tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The node check of a run as the Slurm tests submit it, plus overrides, on node "n7"."""
    cfg = load_config(SYSTEM, [*engine.overrides(tmp_path), f"slurm.folder={tmp_path}/sub/%j", *overrides])
    (tmp_path / "sub").mkdir(exist_ok=True)
    return subprocess.run(
        container.node_check(cfg),
        capture_output=True,
        text=True,
        timeout=120,
        env={**(env or os.environ), "SLURMD_NODENAME": "n7"},
    )


def failed(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done
    return done.stderr.strip()


@PODMAN
def test_the_test_image_passes(engine, tmp_path):
    done = check(engine, tmp_path)
    assert done.returncode == 0, done.stderr


@PODMAN
def test_engine_missing(engine, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    assert failed(check(engine, tmp_path, env={"PATH": str(bin_dir)})) == (
        "flux-train: error: node n7: podman is not installed here (not on PATH): install it on every node, or "
        "choose another container.runtime"
    )


@PODMAN
def test_image_missing(engine, tmp_path):
    assert failed(check(engine, tmp_path, "container.image=localhost/flux-train-ci:nowhere")) == (
        "flux-train: error: node n7: image localhost/flux-train-ci:nowhere is not in the podman image store here: "
        "build or load it on every node (podman load -i FILE), or fix container.image"
    )


@PODMAN
def test_mount_source_missing(engine, tmp_path):
    assert failed(check(engine, tmp_path, "container.mounts=[/nonexistent/cc12m:/data:ro]")) == (
        "flux-train: error: node n7: mount source /nonexistent/cc12m does not exist here: create it on every node "
        "(a shared filesystem), or fix container.mounts"
    )


@PODMAN
def test_rlimit_the_engine_cannot_set(engine, tmp_path):
    # above fs.nr_open: no engine can set that, CAP_SYS_RESOURCE or not
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    assert failed(check(engine, tmp_path, f"container.ulimits.nofile={nr_open + 1}")) == (
        "flux-train: error: node n7: podman cannot set the nofile limit here (higher than this node lets it): set "
        "container.ulimits.nofile lower, e.g. --set container.ulimits.nofile=N:N"
    )


@PODMAN
def test_container_that_does_not_start(engine, tmp_path):
    # the image's own python3 finds the project in the working directory, but not its dependencies
    assert failed(check(engine, tmp_path, "container.python=/usr/bin/python3")) == (
        "flux-train: error: node n7: the container does not start (ModuleNotFoundError: No module named "
        "'submitit'): check container.image, container.python and container.extra_args"
    )


FAKE_ENGINE = """
import json, os, sys
with open(os.environ["FAKE_ENGINE_RECORD"], "a") as record:
    record.write(json.dumps(sys.argv[1:]) + "\\n")
"""


@pytest.mark.parametrize("runtime", ["podman", "apptainer"])
def test_config_strings_stay_inert_in_the_check(tmp_path, runtime):
    marker = tmp_path / "pwned"
    evil = f'x\'; touch {marker}; echo "$(touch {marker})" `touch {marker}`'
    python = f"/opt/py $(touch {marker}) ';touch {marker}'"  # container.python is split like a shell would
    source = tmp_path / f"my data;$(touch {marker})"
    source.mkdir(parents=True)
    image = tmp_path / f"img $(touch {marker});\"q'"
    image.parent.mkdir(parents=True)
    image.write_text("")  # apptainer's image is a file that must be readable
    bin_dir, record = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    (bin_dir / runtime).write_text(f"#!{sys.executable}" + FAKE_ENGINE)
    (bin_dir / runtime).chmod(0o755)
    cfg = load_config(
        SYSTEM,
        [
            f"container.runtime={runtime}",
            f"container.image={json.dumps(str(image))}",
            f"container.mounts={json.dumps([f'{source}:/data'])}",
            f"container.extra_args={json.dumps([evil])}",
            f"container.python={json.dumps(python)}",
            f"slurm.folder={tmp_path}/sub/%j",
        ],
    )
    (tmp_path / "sub").mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_ENGINE_RECORD": str(record)}
    done = subprocess.run(container.node_check(cfg), capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    trial = container.command(cfg)[1][1:] + ["-c", container.TRIAL_IMPORT]
    assert calls == ([trial] if runtime == "apptainer" else [["version"], ["image", "inspect", str(image)], trial])
    assert evil in trial and str(image) in trial and f";touch {marker}" in trial
