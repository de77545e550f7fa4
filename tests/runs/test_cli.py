"""The real entry points, `python -m` in a fresh interpreter each: they report bad input as the in-process calls of
tests/unit/test_cli.py do; --help, --help-config, a bad config and sample's missing folders answered before torch is
imported (a typo'd key in under a third of `import torch`); a missing extra in one line."""

import functools
import subprocess
import sys
import time

import pytest

from dataprep.extras import EXTRA
from flux_train.config import keys
from tests.unit.test_cli import BAD_INPUTS, COMMANDS, DATAPREP, ROOT


@pytest.mark.slow
def test_the_real_entry_points_report_bad_input_the_same(tmp_path):
    """One row per command through `python -m`, side by side."""
    ids = [
        "train-not-a-number",
        "submit-no-runs",
        "bench-zero-steps",
        "results-no-such-run",
        "checkpoint-not-a-checkpoint",
        "dataprep-convert-nothing",
    ]
    (tmp_path / "empty").mkdir()
    fill = functools.partial(str.format, root=ROOT, tmp=tmp_path)
    procs = {}
    for id_, command, argv, expected in (row for row in BAD_INPUTS if row[0] in ids):
        procs[id_] = (
            subprocess.Popen(
                [sys.executable, "-m", command.split()[-1], *map(fill, argv)],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            ),
            fill(expected),
        )
    assert len(procs) == len(ids)
    for id_, (proc, expected) in procs.items():
        err = proc.communicate(timeout=120)[1].strip()
        assert proc.returncode == 2 and err.splitlines() == [err] and expected in err, (id_, err)


def python_m(command: str, argv: list[str], before: str = "", after: str = "") -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` from the repository, with `before` run first in the same interpreter and `after` once
    the command has ended."""
    module = command.split()[-1]
    code = f"import runpy, sys\n{before}\ntry:\n    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    code += f"finally:\n    {after or 'pass'}\n"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_answers_before_torch_is_imported(command):
    """--help in a fraction of a second: the command module parses with flux_train.cli (dataprep.cli) before the
    module that owns the command, and torch with it (seconds), is imported. Checked by what was imported, not a clock."""
    done = python_m(command, ["--help"], after="print('torch imported:', 'torch' in sys.modules)")
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    assert done.stdout.splitlines()[-1] == "torch imported: False"


# every command that takes --set (and with it --help-config), with the words that lead to that parser
CONFIG_COMMANDS = [
    ("python -m flux_train.train", []),
    ("python -m flux_train.submit", []),
    ("python -m flux_train.bench", []),
    ("python -m flux_train.plan", []),
    ("python -m flux_train.checkpoint", ["export"]),
]


@pytest.mark.parametrize("command,argv", CONFIG_COMMANDS, ids=[" ".join([c, *a]) for c, a in CONFIG_COMMANDS])
def test_help_config_lists_every_key_before_torch_is_imported(command, argv):
    """Every key with what it takes, its default and its whole help, answered before torch loads (as --help) and
    before the command's required flags are missed."""
    done = python_m(command, [*argv, "--help-config"], after="print('torch imported:', 'torch' in sys.modules)")
    *listing, last = done.stdout.splitlines()
    assert done.returncode == 0 and last == "torch imported: False", done.stderr
    words = " ".join(" ".join(listing).split())
    for key in keys():
        assert f"{key.name}  {key.accepted()}  (default {key.default_text()})" in listing
        assert " ".join(key.help.split()) in words, key.name
    assert len(keys()) > 100


EARLY = [
    *CONFIG_COMMANDS,
    ("python -m flux_train.cluster.launch", []),
]


@pytest.mark.parametrize("command,argv", EARLY, ids=[" ".join([c, *a]) for c, a in EARLY])
def test_a_bad_config_is_answered_before_torch_is_imported(command, argv):
    """A typo'd key took seconds to be refused (torch, dynamo and inductor were imported first): the command module
    loads the config before the module that owns the command. Checked by what was imported."""
    config = "configs/systems/cpu_02x02.yaml"
    args = [*argv, "--config", config, "--set", "train.lrr=1"] + (["--checkpoint", "x", "--out", "y"] if argv else [])
    done = python_m(command, args, after="print('torch imported:', 'torch' in sys.modules)")
    assert done.returncode == 2 and done.stdout.splitlines()[-1] == "torch imported: False", done.stderr
    assert done.stderr.startswith("config error: unknown key 'train.lrr'; accepted keys here: global_batch_size")


def test_a_missing_folder_of_sample_is_answered_before_torch_is_imported(tmp_path):
    """`sample`'s missing checkpoint or weights folder took 12 s to be named (diffusers and transformers first)."""
    (tmp_path / "prompts.txt").write_text("a cat\n")
    given = {"--checkpoint": tmp_path, "--prompts": tmp_path / "prompts.txt", "--out": tmp_path / "grid.png"}
    given |= {flag: tmp_path for flag in ("--vae", "--t5", "--clip")}
    for flag, expected in (
        ("--checkpoint", "argument --checkpoint: {}: no such file or folder"),
        ("--vae", "argument --vae: {}: not a folder; give the local folder of the weights (nothing downloads)"),
    ):
        args = [str(a) for item in (given | {flag: tmp_path / "nowhere"}).items() for a in item]
        done = python_m("python -m flux_train.sample", args, after="print('torch imported:', 'torch' in sys.modules)")
        assert done.returncode == 2 and done.stdout.splitlines()[-1] == "torch imported: False", done.stderr
        assert expected.format(tmp_path / "nowhere") in done.stderr and len(done.stderr.splitlines()) == 1


def best_of(runs: int, argv: list[str]) -> float:
    """The shortest wall time of `runs` runs of argv from the repository (the least disturbed by other work)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=120)
        times.append(time.perf_counter() - start)
    return min(times)


def test_a_typod_key_is_refused_in_a_fraction_of_the_time_torch_takes_to_import():
    """The README's first command with a typo'd key: refused in under a third of `python -c "import torch"` (a ratio,
    so that a slower machine does not fail it; the refusal took 4 times as long as the import before)."""
    torch_s = best_of(3, [sys.executable, "-c", "import torch"])
    refused_s = best_of(
        3, [sys.executable, "-m", "flux_train.train", "--config", "configs/debug.yaml", "--set", "train.lrr=1"]
    )
    assert refused_s < torch_s / 3, f"refused in {refused_s:.2f} s, torch imports in {torch_s:.2f} s"


# after `pip install -e .` without the extra that brings a command's package: here the package is made unimportable
# in the command's interpreter (None in sys.modules: `import` raises ModuleNotFoundError as for a package that is not
# installed), which leaves the rest of the test's environment as it is
WITHOUT_EXTRAS = [
    ("dataprep-convert", "datasets", DATAPREP, ["convert", "--train", "{tmp}/nowhere", "--out", "{tmp}/ds"]),
    (
        "dataprep-empty-encodings",
        "transformers",
        DATAPREP,
        ["empty-encodings", "--out", "{tmp}/ds", "--t5", "{tmp}", "--clip", "{tmp}"],
    ),
    (
        "sample",
        "transformers",
        "python -m flux_train.sample",
        [
            *["--checkpoint", "{tmp}", "--vae", "{tmp}", "--t5", "{tmp}", "--clip", "{tmp}"],
            *["--prompts", "{tmp}", "--out", "{tmp}/grid.png"],
        ],
    ),
]


@pytest.mark.parametrize(
    "package,command,argv", [row[1:] for row in WITHOUT_EXTRAS], ids=[row[0] for row in WITHOUT_EXTRAS]
)
def test_a_missing_extra_is_one_line_naming_it_and_exit_2(package, command, argv, tmp_path):
    done = python_m(command, [a.format(tmp=tmp_path) for a in argv], before=f"sys.modules[{package!r}] = None")
    err = done.stderr.strip()
    assert done.returncode == 2 and err.splitlines() == [err], err
    extra_name = EXTRA[package]
    assert (
        f"the Python package {package} is not installed; install it with the {extra_name} extra: pip install -e "
        f"'.[{extra_name}]'" in err
    ), err
    # the extra named is one that installs it (pyproject.toml's line `<extra> = [...]`; tomllib is not in Python 3.10)
    extra = next(
        line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith(f"{EXTRA[package]} = [")
    )
    assert f'"{package}"' in extra.partition("=")[2]


def test_export_quiets_the_libraries_without_transformers():
    """checkpoint export needs no extra: silencing the libraries skips transformers where it is not installed."""
    code = "import sys; sys.modules['transformers'] = None\n"
    code += "from flux_train.model.diffusers_adapter import quiet_diffusers; quiet_diffusers()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
