"""The documents' blocks: every fenced block of README.md and docs/*.md either names a language (bash, text, ...) or
is an output block, under a line `<!-- output of: COMMAND -->`; `python` in a documented command is this
interpreter, also in a virtualenv. Output that cannot be reproduced on a CPU machine (a training run's times, GPU
measurements) is tagged `text` and says where it comes from. Each output block equal to what its command prints
now, and the documents' counts of tests: tests/runs/test_doc_outputs.py."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- output of: (.+) -->")


@dataclass
class Block:
    doc: Path
    first: int  # the line of the opening fence, 0-based
    tag: str
    command: str | None  # from the marker line above it

    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.first + 1}"


def blocks(doc: Path) -> list[Block]:
    lines, found, inside = doc.read_text().splitlines(), [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if not inside:
                marker = MARKER.fullmatch(lines[i - 1]) if i else None
                found.append(Block(doc, i, line[3:].strip(), marker and marker.group(1)))
            inside = not inside
    return found


OUTPUTS = [b for doc in DOCUMENTS for b in blocks(doc) if b.command]


def test_every_untagged_block_is_a_checked_output():
    unmarked = [b.where() for doc in DOCUMENTS for b in blocks(doc) if not b.tag and not b.command]
    assert unmarked == [], "tag these blocks (```text) or put `<!-- output of: COMMAND -->` above them"
    assert len(OUTPUTS) >= 5  # the plan's three tables, submit's plan line and its refusal


def test_python_in_a_documented_command_is_this_interpreter_also_in_a_virtualenv(tmp_path):
    """Most users install into a virtualenv: there `python` in a documented command must be the virtualenv's (its
    packages, torch among them, are not the base interpreter's). From a virtualenv made here, the commands' `python`
    (shell.python_on_path) is the virtualenv's; a link to its interpreter outside it started the base one."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], check=True)
    code = (
        "import subprocess, sys; from pathlib import Path; from shell import python_on_path\n"
        "env = python_on_path(Path(sys.argv[1]))\n"
        "print(subprocess.run(['bash', '-c', 'python -c \"import sys; print(sys.prefix)\"'], env=env, "
        "capture_output=True, text=True, check=True).stdout, end='')"
    )
    done = subprocess.run(
        [venv / "bin" / "python", "-c", code, tmp_path / "bin"],
        cwd=ROOT / "tests" / "support",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(venv)
