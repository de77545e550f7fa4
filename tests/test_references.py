"""Every reference in the repository resolves inside it: relative links, file paths named in code, configs and
docs, and `README "Section"` / `docs/x.md ("Section")` references; nothing points at documents outside it: no path
climbs out of the repository, and every Markdown document named is one of the repository's (docs/architecture.md,
"The repository stands alone")."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".yaml", ".sh", ".env", ".toml", ".sbatch")
CLIMB = re.compile(r"(?<![\w.])((?:\.\./)+[\w.-]+)")  # a relative path that starts by going up
DOCUMENT = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
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
DOCUMENTS = {f.name for f in FILES if f.suffix == ".md"}


def test_the_walk_sees_the_repository():
    names = {f.relative_to(ROOT).as_posix() for f in FILES}
    assert {"README.md", "flux_train/train.py", "docs/benchmark.md", "configs/debug.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_references_resolve_inside_the_repository(path):
    text = path.read_text(errors="replace")
    problems = [
        f"names {m.group(1)}, a document the repository does not have"
        for m in DOCUMENT.finditer(text)
        if m.group(1) not in DOCUMENTS
    ]
    for m in CLIMB.finditer(text):
        target = (path.parent / m.group(1)).resolve()
        if ROOT not in target.parents or not target.exists():
            problems.append(f"refers outside the repository: {m.group(1)}")
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
