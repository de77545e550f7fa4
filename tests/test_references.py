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


def tracked_names() -> list[str] | None:
    """The repository's files (git ls-files), or None outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        return listed.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None


def tracked_files() -> list[Path]:
    names = tracked_names()
    if names is None:  # not a git checkout: every file
        files = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    else:
        files = [ROOT / n for n in names]
    return [f for f in files if f.suffix in TEXT and f.is_file() and f.name != Path(__file__).name]


def headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


FILES = tracked_files()
DOCUMENTS = {f.name for f in FILES if f.suffix == ".md"}


# what the repository's top level holds: a file a command's output was redirected into (err.txt) or a plot it wrote
# there is debris, to be removed (or ignored in .gitignore), not committed
FILES_AT_THE_TOP = {".gitignore", "README.md", "pyproject.toml"}
FOLDERS_AT_THE_TOP = {".ci", "configs", "dataprep", "docs", "flux_train", "slurm", "tests"}


def test_the_top_level_holds_only_the_projects_own_entries():
    names = tracked_names()
    if names is None:
        pytest.skip("not a git checkout: no list of the repository's files")
    assert sorted({n.split("/")[0] for n in names} - FILES_AT_THE_TOP - FOLDERS_AT_THE_TOP) == []


def test_the_walk_sees_the_repository():
    names = {f.relative_to(ROOT).as_posix() for f in FILES}
    assert {"README.md", "flux_train/training/train.py", "docs/benchmark.md", "configs/debug.yaml"} <= names


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


# the package's groups, lowest first (docs/architecture.md): a module imports only from its own group or lower ones
GROUPS = ["base", "kernels", "model", "data", "outputs", "training", "tools", "cluster", "commands"]
COMMANDS = {"train", "submit", "bench", "plan", "sample", "results", "checkpoint", "reduce_precision"}


def group_of(module: str) -> str:
    parts = module.split(".")[1:]  # after flux_train
    if len(parts) > 1 and parts[0] in GROUPS:
        return parts[0]
    if parts and parts[0] == "kernels":
        return "kernels"
    return "commands" if parts and parts[0] in COMMANDS else "base"


def test_groups_import_only_downwards():
    import ast

    upward = []
    for path in sorted((ROOT / "flux_train").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("flux_train"):
                names = [f"{node.module}.{a.name}" if node.module == "flux_train" else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("flux_train")]
            for name in names:
                if GROUPS.index(group_of(name)) > GROUPS.index(group_of(module)):
                    upward.append(f"{module} ({group_of(module)}) imports {name} ({group_of(name)})")
    assert not upward, "\n".join(upward)


def test_no_module_imports_one_that_imports_it_back():
    """No import circle inside the package, imports inside functions included: the modules form an order, each
    building on the ones it imports (docs/architecture.md)."""
    import ast

    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / "flux_train").rglob("*.py")
    }
    imports = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("flux_train"):
                # `from package import module` imports the module
                found |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        imports[module] = found & modules.keys() - {module}

    def circle(start: str) -> list[str] | None:
        """A chain of imports from `start` back to it (depth first), or None."""
        seen, todo = set(), [[start]]
        while todo:
            chain = todo.pop()
            for name in sorted(imports[chain[-1]]):
                if name == start:
                    return [*chain, start]
                if name not in seen:
                    seen.add(name)
                    todo.append([*chain, name])
        return None

    circles = [" -> ".join(c) for c in map(circle, sorted(modules)) if c]
    assert not circles, "\n".join(circles)
