"""The container recipes (slurm/containers/Dockerfile.cuda and Dockerfile.rocm) build, for real, with podman: their
copies, their install step and the imports after it run as `docker build` runs them, so a module they name that has
moved, or an extra that is gone, fails here.

NVIDIA's and AMD's base images cannot be pulled on CI. What stands in for them (the recipes' BASE) is the tests'
Debian image (tests/support/containers.py) with a virtualenv over this machine's interpreter and packages (torch
2.13 CPU and the project's dependencies), mounted read-only at the same paths during the build. Like the registry
images it brings a Python with torch; it also brings the dependencies, so the install runs offline (PIP_NO_INDEX)."""

from __future__ import annotations

import re
import site
import subprocess
import sys
from pathlib import Path

import pytest
from containers import interpreter_dirs

from dataprep.extras import EXTRA

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "slurm" / "containers").glob("Dockerfile.*"))
STAND_IN = "localhost/flux-train-ci:recipe-base"
VENV = "/opt/python"


def build(engine, *args: str) -> subprocess.CompletedProcess:
    mounts = [f"--volume={d}:{d}:ro" for d in interpreter_dirs()]
    # every step run (a cached step would not run, nor print, the recipe's imports), no intermediate images kept
    argv = ["podman", "build", "--no-cache", "--layers=false", *[f"--ulimit={u}" for u in engine.limits], *mounts]
    argv += args
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def stand_in(engine, tmp_path_factory) -> str:
    """The base image standing in for the registries'; removed after the module's tests."""
    # the virtualenv sees the interpreter's packages (--system-site-packages) and, where the tests run in a
    # virtualenv themselves, that one's too (the .pth file)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    folder = tmp_path_factory.mktemp("stand-in")
    (folder / "Containerfile").write_text(
        f"FROM {engine.image}\n"
        f"RUN {sys.executable} -m venv --system-site-packages --without-pip {VENV} "
        f"&& printf '%s\\n' {' '.join(site.getsitepackages())} > {VENV}/lib/{version}/site-packages/tests.pth\n"
        f"ENV PATH={VENV}/bin:$PATH PIP_NO_INDEX=1 PIP_NO_BUILD_ISOLATION=0\n"  # 0: no isolation (pip's inversion)
    )
    done = build(engine, "--tag", STAND_IN, str(folder))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    yield STAND_IN
    subprocess.run(["podman", "rmi", "--force", STAND_IN], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["podman"], indirect=True)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_recipe_builds_and_imports_what_its_jobs_run(recipe, engine, stand_in):
    tag = f"localhost/flux-train-ci:recipe-{recipe.suffix[1:]}"
    done = build(engine, "--build-arg", f"BASE={stand_in}", "--file", str(recipe), "--tag", tag, str(ROOT))
    subprocess.run(["podman", "rmi", "--force", tag], capture_output=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "flux-train on torch 2.13" in done.stdout  # the recipe's own last line: its imports ran
    assert "does not provide the extra" not in done.stdout + done.stderr  # pip only warns about a missing extra


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_recipe_installs_the_extras_of_the_commands_its_users_run(recipe):
    """The stand-in base already has every package, so the build alone would not miss one the install left out."""
    installed = re.search(r"pip install .* -e '\.\[([\w,]+)\]'", recipe.read_text())
    assert installed and set(EXTRA.values()) <= set(installed.group(1).split(","))
