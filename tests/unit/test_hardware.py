"""The table of GPU kinds (flux_train/hardware.py): what it says holds together, and a kind is added by its row
alone: MFU's peak, the attention backend, the e4m3 format, pre-flight's name check and the planner all take it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from flux_train import hardware
from flux_train.config import load_config
from flux_train.hardware import KINDS, kind_of, of_arch
from flux_train.kernels.fp8 import device_e4m3
from flux_train.tools import plan
from flux_train.tools.plan_figures import FIGURES_FILE
from flux_train.training import perf, preflight
from flux_train.training.metrics import peak_tflops

GPU = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "device_name,kind",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 NVL", "H100"),
        ("NVIDIA H200", "H200"),
        ("h200", "H200"),  # as plan --gpu may give it
        ("NVIDIA B200", "B200"),
        ("AMD Instinct MI300X", "MI300X"),
        ("AMD Instinct MI325X", "MI325X"),
        ("AMD Instinct MI355X", "MI355X"),
        ("NVIDIA GH200 480GB", None),  # an H100-class GPU beside a Grace CPU, not an H200
        ("NVIDIA GB200", None),
        ("NVIDIA A100-SXM4-80GB", None),
        ("", None),
    ],
)
def test_a_gpu_name_names_a_kind_as_a_whole_word(device_name, kind):
    found = kind_of(device_name)
    assert (found and found.name) == kind


def test_kinds_of_one_architecture_say_the_same_of_it():
    """Attention and e4m3 are the architecture's: every kind of one arch says the same, as a backend perf.py
    switches on and a torch e4m3 dtype; names are unique and no kind's name names another."""
    for arch in {k.arch for k in KINDS}:
        assert len({(k.attention, k.e4m3) for k in KINDS if k.arch == arch}) == 1, arch
    for k in KINDS:
        assert k.attention in ("flash", "cudnn")
        assert getattr(torch, k.e4m3).itemsize == 1 and "e4m3" in k.e4m3
        assert kind_of(k.name) == k and 0 < k.bf16_tflops < k.fp8_tflops and k.memory_gib > 0
    assert of_arch("gfx942:sramecc+:xnack-") == of_arch("gfx942") and of_arch("sm_80") is None


def test_measured_yaml_holds_measurements_of_the_tables_kinds_only():
    measured = yaml.safe_load(FIGURES_FILE.read_text())
    assert set(measured) <= {k.name for k in KINDS}
    for kind, entry in measured.items():
        for name, figure in entry.get("figures", {}).items():
            assert {"date", "command"} <= figure.keys() and "spec" not in figure, f"{kind} {name}"


def a_gpu(monkeypatch, device_name: str, arch: str) -> None:
    """One GPU of this name and architecture, as torch reports it (ROCm for a gfx target)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))  # idle
    if arch.startswith("gfx"):
        monkeypatch.setattr(torch.version, "hip", "6.4")
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(gcnArchName=arch))
    else:
        monkeypatch.setattr(torch.version, "hip", None)
        capability = divmod(int(arch.removeprefix("sm_")), 10)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def seen(kind: hardware.Kind, tmp_path: Path) -> dict:
    """What each reader of the table makes of one GPU of `kind` (a_gpu), pre-flight expecting that kind."""
    cfg = load_config("configs/debug.yaml", [f"logging.out_dir={tmp_path}", f"preflight.gpu_name={kind.name}"])
    figures = plan.Figures(kind.name)
    return {
        "mfu peak": peak_tflops(GPU),
        "attention": perf.preferred_attention(GPU),
        "e4m3": device_e4m3(GPU),
        "pre-flight": preflight.node_problems(cfg, GPU, 1),
        "plan": figures.known and figures.figure("memory_gib"),
    }


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_kind_is_added_by_its_row_alone(kind, monkeypatch, tmp_path):
    """The table without this kind and its architecture (as before it was added): its GPU has no MFU peak, flash
    attention, OCP e4m3, and the plan refuses it; the row added back, and nothing else, every reader takes its
    columns. Pre-flight's name check needs no row: `preflight.gpu_name` matches as the table does (a whole word)."""
    a_gpu(monkeypatch, f"Vendor {kind.name} 1TB", kind.arch)
    before = tuple(k for k in KINDS if k.arch != kind.arch)
    monkeypatch.setattr(hardware, "KINDS", before)
    assert seen(kind, tmp_path) == {
        "mfu peak": None,
        "attention": "flash",
        "e4m3": torch.float8_e4m3fn,
        "pre-flight": [],
        "plan": False,
    }
    monkeypatch.setattr(hardware, "KINDS", (*before, kind))
    assert seen(kind, tmp_path) == {
        "mfu peak": kind.bf16_tflops,
        "attention": kind.attention,
        "e4m3": getattr(torch, kind.e4m3),
        "pre-flight": [],
        "plan": (kind.memory_gib, f"{kind.memory_gib:g} GiB ({kind.name}, spec: {kind.memory_spec})"),
    }


def test_a_new_kind_plans_as_the_unmeasured_kinds_do(monkeypatch, tmp_path, capsys):
    """A B300 row (not in the table) added by the test: `plan --gpu B300` prints its memory from the row and names
    the bench commands that measure the rest; a GPU of another kind fails pre-flight's check for it."""
    b200 = kind_of("B200")
    assert b200 is not None and kind_of("B300") is None
    b300 = dataclasses.replace(b200, name="B300", arch="sm_103", memory_gib=268.0, memory_spec="the test's")
    monkeypatch.setattr(hardware, "KINDS", (*KINDS, b300))
    png = tmp_path / "plan.png"
    assert plan.main(["--config", "configs/systems/H200_01x08.yaml", "--gpu", "b300", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "  memory               268 GiB (B300, spec: the test's)" in out.splitlines()
    assert "missing: nothing is measured on B300 yet" in out
    a_gpu(monkeypatch, "NVIDIA B200", "sm_100")
    cfg = load_config("configs/debug.yaml", [f"logging.out_dir={tmp_path}", "preflight.gpu_name=B300"])
    assert preflight.node_problems(cfg, GPU, 1) == ["GPU 0 is a NVIDIA B200, expected B300 (preflight.gpu_name)"]
