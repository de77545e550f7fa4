"""The GPU kinds, in one table that everything reading a kind takes it from: the peak for MFU
(flux_train/training/metrics.py), the attention backend `perf.attention=auto` tries (flux_train/training/perf.py),
the e4m3 format of FP8 (flux_train/kernels/fp8.py), pre-flight's check of `preflight.gpu_name` and the planner's
memory (flux_train/tools/plan_figures.py; what was measured per kind is flux_train/tools/measured.yaml). Adding a kind
is one row here, its bench rows there and a system config (configs/systems/). No torch at import: the parsers may
read it too."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Kind:
    name: str  # a whole word of the GPU's name (torch.cuda.get_device_name); preflight.gpu_name and plan --gpu say it
    arch: str  # sm_<major><minor> (CUDA's compute capability) or the ROCm gfx target
    bf16_tflops: float  # the vendor's dense peaks: MFU is against bf16's in every precision
    fp8_tflops: float
    memory_gib: float  # what the planner fits a run into: the vendor's figure (as the driver reports it, where read)
    memory_spec: str  # where memory_gib comes from, printed beside it
    # of the architecture (every kind of one arch says the same: tests/unit/test_hardware.py): the SDPA backend
    # measured fastest for Flux's attention, and the torch e4m3 dtype its matrix cores take
    attention: str
    e4m3: str


# cuDNN attention on Hopper: forward+backward 0.66 ms against flash's 1.00 on an H200 (torch 2.11, cuDNN 9 for CUDA 13;
# docs/performance.md "Performance"); flash elsewhere (ROCm's flash is its own kernels, cuDNN is NVIDIA's, Blackwell
# is not measured). e4m3: OCP's float8_e4m3fn, but gfx942's matrix cores take only float8_e4m3fnuz (max 240).
KINDS = (
    Kind("H100", "sm_90", 989.0, 1979.0, 79.6, "NVIDIA H100 SXM 80 GB; nvidia-smi reports 81,559 MiB", "cudnn", "float8_e4m3fn"),
    Kind("H200", "sm_90", 989.0, 1979.0, 140.4, "NVIDIA H200 SXM 141 GB; nvidia-smi reports 143,771 MiB", "cudnn", "float8_e4m3fn"),
    Kind("B200", "sm_100", 2250.0, 4500.0, 180.0, "NVIDIA HGX B200, 180 GB HBM3E", "flash", "float8_e4m3fn"),
    Kind("MI300X", "gfx942", 1307.0, 2615.0, 192.0, "AMD Instinct MI300X, 192 GB HBM3", "flash", "float8_e4m3fnuz"),
    Kind("MI325X", "gfx942", 1307.0, 2615.0, 256.0, "AMD Instinct MI325X, 256 GB HBM3E", "flash", "float8_e4m3fnuz"),
    Kind("MI355X", "gfx950", 2500.0, 5000.0, 288.0, "AMD Instinct MI355X, 288 GB HBM3E", "flash", "float8_e4m3fn"),
)  # fmt: skip


def named(kind: str, device_name: str) -> bool:
    """Whether a GPU's name names this kind, as a whole word in any case: "NVIDIA H200" and "h200" do, "NVIDIA GH200"
    (an H100-class GPU beside a Grace CPU) does not."""
    return re.search(rf"(?<![a-z0-9]){re.escape(kind)}(?![a-z0-9])", device_name, re.IGNORECASE) is not None


def kind_of(device_name: str) -> Kind | None:
    """The kind a GPU's name (or a kind's name, as a flag gives it) names, or None: a GPU the table does not hold."""
    return next((k for k in KINDS if named(k.name, device_name)), None)


def of_arch(arch: str) -> Kind | None:
    """A kind of this architecture, for the columns that are the architecture's (attention, e4m3), or None. A ROCm
    target's feature flags (gfx942:sramecc+:xnack-) are left out: an MI300A or MI308X is a gfx942 as the MI300X is."""
    return next((k for k in KINDS if k.arch == arch.split(":")[0]), None)


def device_arch(device: torch.device) -> str:
    """A GPU's architecture as the table names it."""
    import torch  # here, not at the top: importing the table needs no torch

    if torch.version.hip:
        return torch.cuda.get_device_properties(device).gcnArchName
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"
