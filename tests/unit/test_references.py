"""Every reference in the repository resolves inside it: relative links, file paths named in code, configs and
docs, and `README "Section"` / `docs/x.md ("Section")` references; nothing points at documents outside it: no path
climbs out of the repository, and every Markdown document named is one of the repository's (docs/architecture.md,
"The repository stands alone"). And the imports docs/architecture.md allows: flux_train's groups only downwards,
dataprep nothing of flux_train."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    for m in PATH.finditer("" if path.relative_to(ROOT).parts[0] == "tests" else text):
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
    if parts and parts[0] in GROUPS:
        return parts[0]
    return "commands" if parts and parts[0] in COMMANDS else "base"


def module_name(path: Path, top: Path) -> str:
    """flux_train/model/flux.py under `top` -> flux_train.model.flux (a package: its __init__'s folder)."""
    return ".".join(path.relative_to(top).with_suffix("").parts).removesuffix(".__init__")


def flux_train_imports(path: Path, top: Path) -> list[str]:
    """What the file at `path` (a module under `top`) imports from flux_train, anywhere in it (a function's import
    too): `from X import y` as X.y, y being a module or a name in X; a relative import resolved first."""
    module = module_name(path, top)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            found += [f"{base if node.level else node.module}.{a.name}" for a in node.names]
    return [name for name in found if name.split(".")[0] == "flux_train"]


def upward_imports(top: Path) -> list[str]:
    """Every import in top/flux_train that goes up the groups."""
    upward = []
    for path in sorted((top / "flux_train").rglob("*.py")):
        module = module_name(path, top)
        for name in flux_train_imports(path, top):
            if GROUPS.index(group_of(name)) > GROUPS.index(group_of(module)):
                upward.append(f"{module} ({group_of(module)}) imports {name} ({group_of(name)})")
    return upward


def test_groups_import_only_downwards():
    assert upward_imports(ROOT) == []


def plant(top: Path, files: dict[str, str]) -> None:
    """A flux_train package under `top` made of `files` (path in the package -> source)."""
    for name, text in files.items():
        (top / "flux_train" / name).parent.mkdir(parents=True, exist_ok=True)
        (top / "flux_train" / name).write_text(text)


def test_the_group_check_finds_an_upward_import(tmp_path):
    """A planted tree: an import up the groups is reported however it is written; one down or sideways is not."""
    planted = {
        "__init__.py": "",
        "config.py": "import flux_train.train\n",
        "model/__init__.py": "",
        "model/flux.py": "from flux_train.training.train import Trainer\n",
        "model/flow.py": "def later():\n    from flux_train.training import train\n",
        "model/adapter.py": "from ..cluster import submit\n",
        "model/fine.py": "import flux_train.model.flux\nfrom flux_train import config\nfrom . import flow\n",
        "training/__init__.py": "from flux_train.kernels import rmsnorm\nfrom flux_train.model import flux\n",
    }
    plant(tmp_path, planted)
    assert upward_imports(tmp_path) == [
        "flux_train.config (base) imports flux_train.train (commands)",
        "flux_train.model.adapter (model) imports flux_train.cluster.submit (cluster)",
        "flux_train.model.flow (model) imports flux_train.training.train (training)",
        "flux_train.model.flux (model) imports flux_train.training.train.Trainer (training)",
    ]


def test_dataprep_imports_nothing_from_flux_train():
    """flux_train imports dataprep, not the other way (docs/architecture.md): no file of dataprep names flux_train in an
    import, and importing every module of it, `python -m dataprep`'s first, loads none of flux_train."""
    assert {p.name: flux_train_imports(p, ROOT) for p in sorted((ROOT / "dataprep").glob("*.py"))} == {
        p.name: [] for p in sorted((ROOT / "dataprep").glob("*.py"))
    }
    code = (
        "import importlib, pkgutil, sys, dataprep.__main__\n"
        "for found in pkgutil.iter_modules(dataprep.__path__):\n"
        "    importlib.import_module('dataprep.' + found.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flux_train'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stdout + done.stderr


def import_circles(top: Path) -> list[str]:
    """Every chain of imports in top/flux_train from a module back to itself (imports inside functions and relative
    ones included: flux_train_imports), one per module that starts one."""
    paths = {module_name(p, top): p for p in (top / "flux_train").rglob("*.py")}
    imports = {}
    for module, path in paths.items():
        # `from package import module` imports the module, `from module import name` the module
        named = {n if n in paths else n.rsplit(".", 1)[0] for n in flux_train_imports(path, top)}
        imports[module] = named & paths.keys() - {module}

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

    return [" -> ".join(c) for c in map(circle, sorted(paths)) if c]


def test_no_module_imports_one_that_imports_it_back():
    """No import circle inside the package, imports inside functions included: the modules form an order, each
    building on the ones it imports (docs/architecture.md)."""
    circles = import_circles(ROOT)
    assert not circles, "\n".join(circles)


def test_the_circle_check_finds_a_circle_however_its_imports_are_written(tmp_path):
    """A planted tree: a circle through a relative import and one inside a function is reported from each of its
    modules; modules that only import into it are not."""
    planted = {
        "__init__.py": "",
        "data/__init__.py": "",
        "data/sources.py": "from . import energon\n",
        "data/energon.py": "def later():\n    from flux_train.data.sources import build_data\n",
        "data/contract.py": "from flux_train.data import sources\n",
    }
    plant(tmp_path, planted)
    assert import_circles(tmp_path) == [
        "flux_train.data.energon -> flux_train.data.sources -> flux_train.data.energon",
        "flux_train.data.sources -> flux_train.data.energon -> flux_train.data.sources",
    ]
