"""The container engines of the launcher tests, as .ci/containers leaves them in $FLUX_CI_CACHE (default
/var/cache/flux-train-ci): podman with the image localhost/flux-train-ci:bookworm, and apptainer (from PATH, or
the Debian sid one through bin/apptainer) with the same rootfs as a sandbox image. The image is a bare Debian
with python3: this machine's interpreter and virtualenv are mounted read-only at the same paths, and the project
is the submit directory, which the launcher mounts itself. Without an engine or its image the tests skip, except
in CI, where they fail; apptainer skips with the reason .ci/containers gave when it could not set it up."""

from __future__ import annotations

import json
import os
import resource
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from run_outputs import set_flags

CACHE = Path(os.environ.get("FLUX_CI_CACHE", "/var/cache/flux-train-ci"))
PODMAN_IMAGE = "localhost/flux-train-ci:bookworm"
SETUP = ".ci/containers builds it"


@dataclass
class Engine:
    runtime: str
    image: str
    path: str = ""  # prepended to PATH for submit (and so for the job)
    sets: list[str] = field(default_factory=list)  # --set overrides this engine needs here
    limits: list[str] = field(default_factory=list)  # podman: the --ulimit values its containers need here

    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.path}:{os.environ['PATH']}" if self.path else os.environ["PATH"]}

    def overrides(self, tmp_path: Path) -> list[str]:
        """Config overrides for a run in this engine's container, with tmp_path (outputs, node-local dirs) mounted."""
        mounts = [str(tmp_path)] + [f"{p}:{p}:ro" for p in interpreter_dirs()]
        return [
            f"container.runtime={self.runtime}",
            f"container.image={self.image}",
            f"container.mounts={json.dumps(mounts)}",
            f"container.python={sys.executable}",
            f"env.local_dir={tmp_path}/local",
            *self.sets,
        ]

    def args(self, tmp_path: Path) -> list[str]:
        """The same as flags of `python -m flux_train.submit`."""
        return set_flags(self.overrides(tmp_path))


def interpreter_dirs() -> list[str]:
    """What this interpreter needs besides the image: its prefix, its virtualenv and site-packages."""
    dirs = sorted({sys.base_prefix, sys.prefix, *site.getsitepackages()})
    return [d for d in dirs if not any(d.startswith(other + "/") for other in dirs)]


def unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} ({SETUP}, run by .ci/run)")
    pytest.skip(reason)


def podman_limits(image: str) -> list[str]:
    """The ulimits (NAME=VALUE, podman's --ulimit) this machine's podman must be given to start a container.
    Without CAP_SYS_RESOURCE it cannot raise a limit above its own (podman's own nproc can be lower than the
    shell's): then the hard limits, nproc halved until a container starts. Where the defaults (memlock unlimited)
    start one, none."""

    def starts(*ulimits: str) -> bool:
        argv = ["podman", "run", "--rm", *[f"--ulimit={u}" for u in ulimits], image, "true"]
        return subprocess.run(argv, capture_output=True).returncode == 0

    if starts("memlock=-1:-1"):
        return []
    memlock, nofile = (resource.getrlimit(r)[1] for r in (resource.RLIMIT_MEMLOCK, resource.RLIMIT_NOFILE))
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    while nproc > 1024 and not starts(f"memlock={memlock}", f"nofile={nofile}", f"nproc={nproc}"):
        nproc //= 2
    return [f"memlock={memlock}", f"nofile={nofile}", f"nproc={nproc}"]


@pytest.fixture(scope="session")
def engine(request) -> Engine:
    """The engine named by the test's parameter ("podman" or "apptainer"), ready to run the test image."""
    if request.param == "podman":
        if shutil.which("podman") is None:
            unavailable("podman is not installed (apt-get install podman runc)")
        if subprocess.run(["podman", "image", "exists", PODMAN_IMAGE]).returncode:
            unavailable(f"podman image {PODMAN_IMAGE} is missing")
        limits = podman_limits(PODMAN_IMAGE)
        ulimits = ", ".join(f"{name}: '{value}'" for name, _, value in (limit.partition("=") for limit in limits))
        return Engine(
            "podman", PODMAN_IMAGE, sets=[f"container.ulimits={{{ulimits}}}"] if limits else [], limits=limits
        )
    reason = CACHE / "apptainer.unavailable"
    if reason.is_file():
        pytest.skip(f"apptainer: {reason.read_text().strip()}")
    path = "" if shutil.which("apptainer") else str(CACHE / "bin")
    if not shutil.which("apptainer", path=path or None) or not (CACHE / "bookworm").is_dir():
        unavailable(f"apptainer or its sandbox image {CACHE / 'bookworm'} is missing")
    # apptainer binds /tmp, $HOME and the working directory by default: without them a bind the launcher
    # forgot shows
    return Engine("apptainer", str(CACHE / "bookworm"), path, ["container.extra_args=['--no-mount=tmp,home,cwd']"])
