"""Every reference in the repository resolves inside it: relative links, file paths named in code, configs and
docs, and `README "Section"` / `docs/x.md ("Section")` references; nothing points at documents outside it."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".yaml", ".sh", ".env", ".toml", ".sbatch")
# documents that lived beside the repository once; a clone has none of them
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|shared/notes|\b(?:reference|anchors|stack)\.md")
PATH = re.compile(r"(?<![\w./-])((?:flux_train|dataprep|configs|slurm|tests|docs|\.ci)/[\w./-]*\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SECTION = re.compile(r'(README(?:\.md)?|docs/[\w-]+\.md),? \(?"([^"]+)"')


def tracked_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = [ROOT / n for n in names.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file
        files = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [f for f in files if f.suffix in TEXT and f.is_file() and f.name != Path(__file__).name]


def headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


FILES = tracked_files()


def test_the_walk_sees_the_repository():
    names = {f.relative_to(ROOT).as_posix() for f in FILES}
    assert {"README.md", "flux_train/train.py", "docs/benchmark.md", "configs/debug.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_references_resolve_inside_the_repository(path):
    text = path.read_text(errors="replace")
    problems = [f"refers outside the repository: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    # tests name missing files on purpose (bad inputs); everywhere else a named file must exist
    for m in PATH.finditer("" if path.parent.name == "tests" else text):
        name = m.group(1).rstrip(".")
        if text[m.end() : m.end() + 1] in "*{<$" or name.endswith("/"):
            continue  # a pattern or a placeholder, not a file
        if not (ROOT / name).exists():
            problems.append(f"names {name}, which does not exist")
    for m in LINK.finditer(text):
        target = m.group(1)
        if not target.startswith(("http://", "https://", "mailto:")) and not (path.parent / target).exists():
            problems.append(f"links {target}, which does not exist")
    for m in SECTION.finditer(text):
        doc = ROOT / ("README.md" if m.group(1).startswith("README") else m.group(1))
        if not doc.is_file():
            problems.append(f"refers to {m.group(1)}, which does not exist")
        elif not any(m.group(2) in h for h in headings(doc)):
            problems.append(f'refers to section "{m.group(2)}" of {m.group(1)}, which has no such heading')
    assert not problems, "\n".join(problems)
