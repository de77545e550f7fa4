"""What README.md and docs/*.md show a command printing is what it prints now. A block of output sits under a line
`<!-- output of: COMMAND -->`; COMMAND runs in bash, in a scratch folder holding the repository's configs/ (so
paths print as documented), and the block must equal its standard output; it writes nothing there but under runs/.
FLUX_DOCS_REGENERATE=1 writes the current output into the documents instead of failing. Message shapes quoted
inline with placeholders (`node gpu07`, `pid N`) are not outputs and are not checked. The blocks' tags:
tests/unit/test_doc_outputs.py. And the counts of tests README.md and docs/testing.md give are the suite's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from shell import python_on_path

from tests.unit.test_doc_outputs import OUTPUTS, ROOT, Block


def replace_block(block: Block, output: list[str]) -> None:
    """Write `output` between the fences of the block under the block's marker."""
    lines = block.doc.read_text().splitlines()
    start = lines.index(f"<!-- output of: {block.command} -->") + 2
    end = lines.index("```", start)
    block.doc.write_text("\n".join([*lines[:start], *output, *lines[end:]]) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("block", OUTPUTS, ids=lambda b: b.command)
def test_a_documented_output_is_what_the_command_prints(block, tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    # `python` is this interpreter, and the package this checkout's, wherever an installed one points
    env = python_on_path(tmp_path / "bin") | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["bash", "-c", block.command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    printed = [line.rstrip() for line in done.stdout.rstrip("\n").splitlines()]
    assert printed, f"{block.command} printed nothing: {done.stderr[-2000:]}"
    # what a documented command writes goes under the run's folder (the plan's plot was left where plan ran)
    assert {p.name for p in tmp_path.iterdir()} <= {"configs", "bin", "runs"}
    if os.environ.get("FLUX_DOCS_REGENERATE"):
        replace_block(block, printed)
    lines = block.doc.read_text().splitlines()
    start = lines.index(f"<!-- output of: {block.command} -->") + 2
    shown = lines[start : lines.index("```", start)]
    assert shown == printed, (
        f"{block.where()} differs from what the command prints (FLUX_DOCS_REGENERATE=1 rewrites it)"
    )


# a pytest plugin: how many tests the suite collects, how many need a GPU, and how many Slurm or podman (the launcher's
# tests on a real Slurm and in real containers: the `slurm` marker, or the container engine's fixture)
COUNTING = """
def pytest_collection_finish(session):
    gpu = [i for i in session.items if "gpu" in i.keywords]
    launcher = [i for i in session.items if i not in gpu and ("slurm" in i.keywords or "engine" in i.fixturenames)]
    print(f"COUNTS {len(session.items)} {len(gpu)} {len(launcher)}")
"""


@pytest.mark.slow
def test_the_documents_count_the_tests_there_are(tmp_path):
    """README.md and docs/testing.md say how many tests there are, how many need a GPU and how many Slurm and podman
    (they skip without them), and what the last whole run gave; the counts are the suite's as pytest collects it now,
    and that run's passed and skipped add up to them (the README said 668 passed, 11 skipped long after). A test
    added or removed: update the counts (this test prints them) and the run, from a whole run."""
    (tmp_path / "counting.py").write_text(COUNTING)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "counting"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    counts = re.search(r"^COUNTS (\d+) (\d+) (\d+)$", done.stdout, re.M)
    assert counts, done.stdout[-2000:] + done.stderr[-2000:]
    total, gpu, launcher = map(int, counts.groups())
    for doc in (ROOT / "README.md", ROOT / "docs" / "testing.md"):
        text = " ".join(doc.read_text().split())
        stated = re.search(r"(\d+) tests, (\d+) of them on a GPU and (\d+) on Slurm and podman", text)
        assert stated and tuple(map(int, stated.groups())) == (total, gpu, launcher), (
            f"{doc.name} should say {total} tests, {gpu} of them on a GPU and {launcher} on Slurm and podman"
        )
        passed, skipped = map(int, re.search(r"(\d+) passed, (\d+) skipped", text).groups())
        assert passed + skipped == total, f"{doc.name}: the last whole run's counts are not this suite's"
