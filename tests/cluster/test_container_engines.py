"""The container engines' table (flux_train/container_engines.py): it is the config's and the command line's list of
runtimes, no engine's name is compared anywhere else, and a new engine is one class and one row of the table: a
copy of the project with enroot added so, and nothing else changed, submits a dry run in it."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

from flux_train.cli import submit_parser
from flux_train.config import ContainerConfig
from flux_train.container_engines import ENGINES

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "flux_train" / "container_engines.py"


def test_the_engine_table_is_the_configs_runtimes():
    assert typing.get_args(typing.get_type_hints(ContainerConfig)["runtime"]) == tuple(ENGINES)
    (runtime,) = [a for a in submit_parser()._actions if a.dest == "runtime"]
    assert tuple(runtime.choices or ()) == tuple(ENGINES)
    assert all(engine.name == name for name, engine in ENGINES.items())
    # the node check reads as one quoted word in the batch script: no single quotes in it
    assert not [name for name, engine in ENGINES.items() if "'" in (engine.image_check or "")]


def engine_names(path: Path) -> list[str]:
    """Where the module at `path` names a container engine in its code: a string that is one's name, a comparison
    with container.runtime, or a bash test of an engine's name in a script it holds."""
    names = [name for name in ENGINES if name != "none"]  # "none" is a value of other keys too
    bash_test = re.compile(rf"(?:=|!=)\s*\"?({'|'.join(names)})\b")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in names:
                found.append(f"{path.name}:{node.lineno} {node.value}")
            found += [f"{path.name}:{node.lineno} bash {m.group(1)}" for m in bash_test.finditer(node.value)]
        elif isinstance(node, ast.Compare):
            sides = [n for side in (node.left, *node.comparators) for n in ast.walk(side)]
            if any(isinstance(n, ast.Attribute) and n.attr == "runtime" for n in sides):
                found.append(f"{path.name}:{node.lineno} runtime")
    return found


def test_no_engine_is_named_outside_the_table(tmp_path):
    """Everything else asks the engine (its options, command line, GPU arguments, image rule, check lines) instead
    of naming it; the check finds a name however it is written."""
    modules = [p for p in sorted((ROOT / "flux_train").rglob("*.py")) if p != TABLE]
    assert [hit for path in modules for hit in engine_names(path)] == []
    planted = tmp_path / "planted.py"
    planted.write_text(
        'a = c.runtime == "none"\n'
        'b = engine in ("pyxis", "none")\n'
        'argv = ["apptainer", "exec"]\n'
        'CHECK = """\nif [ "$engine" = podman ]; then\n"""\n'
        'HELP = "docker/podman only"\n'
    )
    assert sorted(engine_names(planted)) == [
        "planted.py:1 runtime",
        "planted.py:2 pyxis",
        "planted.py:3 apptainer",
        "planted.py:4 bash podman",
    ]


# an engine as a site would add it: enroot (NVIDIA's, which pyxis drives under srun) started by its own command
ENROOT = '''

class Enroot(Engine):
    """enroot start: a squashfs image (enroot import) as each node's container; the job's environment passed whole."""

    name = "enroot"
    image_check = r"""[ -r "$image" ] || fail "image $image is missing or unreadable here:" \\
  "copy it to every node (a shared filesystem), or fix container.image"
"""

    def argv(self, launch: Launch) -> list[str]:
        mounts = [f"--mount={bind}" for bind in launch.binds]
        return [self.name, "start", "--rw", *mounts, *launch.extra_args, launch.image, *launch.python]

    def image_is_path(self, image: str) -> bool:
        return True
'''


def with_enroot(top: Path) -> None:
    """The project's code and configs under `top`, enroot added to its engines by one class and one row."""
    for folder in ("flux_train", "dataprep", "configs", "slurm"):
        shutil.copytree(ROOT / folder, top / folder, ignore=shutil.ignore_patterns("__pycache__"))
    table = top / "flux_train" / "container_engines.py"
    text = table.read_text()
    assert text.count("\n\nENGINES: ") == 1 and text.count("        Podman(),\n") == 1
    text = text.replace("\n\nENGINES: ", ENROOT + "\n\nENGINES: ")
    table.write_text(text.replace("        Podman(),\n", "        Podman(),\n        Enroot(),\n"))


def test_a_new_engine_is_one_class_and_one_row(tmp_path):
    top = tmp_path / "project"
    with_enroot(top)
    changed = [
        str(p.relative_to(top))
        for p in sorted(top.rglob("*"))
        if p.is_file() and p.read_bytes() != (ROOT / p.relative_to(top)).read_bytes()
    ]
    assert changed == ["flux_train/container_engines.py"]
    # the config takes it (--set: the config's type), and so does the command line (--runtime: its choices)
    base = ["--config", "configs/systems/cpu_02x02.yaml", "--set", f"slurm.folder={tmp_path}/sub/%j"]
    code = (
        "from flux_train.cluster import submit\n"
        f"dry = submit.main({base!r} + ['--dry-run', '--set', 'container.runtime=enroot', '--container-image',"
        " './flux.sqsh', '--mounts', '/data:/d:ro'])\n"
        f"local = submit.main({base!r} + ['--local', '--runtime', 'pyxis', '--container-image', 'x'])\n"
        "print('CODES', dry, local)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=top,
        env={**os.environ, "PYTHONPATH": str(top)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "CODES 0 2" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    out, cwd = done.stdout, str(top)
    assert "container enroot, image ./flux.sqsh" in out  # the job's summary
    node = out.split("# ---- per-node command", 1)[1].split("# ----", 1)[0]
    words = [line.strip() for line in node.splitlines()[1:]]
    start = words.index("enroot")
    mounts = [f"--mount={cwd}:{cwd}", f"--mount={tmp_path}/sub:{tmp_path}/sub", "--mount=/data:/d:ro"]
    assert words[start:] == [
        "enroot",
        "start",
        "--rw",
        *mounts,
        "./flux.sqsh",
        "/usr/bin/env",
        "python3",
        "-u",
        "-m",
        "submitit.core._submit",
        f"{tmp_path}/sub/%j",
    ]
    # each node checks its engine, the mount sources and the image before the agents start
    assert "flux-train-check enroot ./flux.sqsh" in out and '[ -r "$image" ]' in out
    # the image is a path, which this host does not have
    assert "container.image ./flux.sqsh does not exist on this host" in done.stderr
    assert (
        "--local cannot use pyxis (it is an srun plugin): add --runtime none, apptainer, docker, podman or enroot"
        in (done.stderr)
    )
