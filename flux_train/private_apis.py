"""The dependencies' private APIs that flux-train relies on, all of them, in one place, with the version range
they are tested against (pyproject.toml pins it). The first five are wrapped below; the others are used where they
are, in the file named. None has a public equivalent; a release that changes one breaks here, and the tests
named beside each fail first.

- submitit 1.5 (<1.6): `_make_sbatch_string`, the sbatch script submitit would submit; `submit --dry-run`
  prints it (submitit has no public dry run). Tests: tests/cluster/test_submit.py.
- megatron-energon 7.3-7.x (<8): `Sharder.split_samples_to_workers`, energon's split of a split's samples over
  the global workers, so that validation counts every sample once on any rank count. Tests:
  tests/runs/test_data_energon.py.
- megatron-energon 7.x: the `<shard>.tar.idx` files its `prepare` writes beside each shard (uint64 byte offsets of
  the samples, then the end of the last), so that a shard cut short is named before the run reads it. Tests:
  tests/unit/test_data_energon.py.
- megatron-energon 7.x: the module-level `print` of `megatron.energon.errors`, through which `ErrorContext` prints
  "Except <error> in <stage>" on stdout before it calls the error handler; with ours (`reraise_exception`) the
  error reaches the trainer, which names it in one line, so the print is dropped (`quiet_energon_sample_errors`).
  Tests: tests/unit/test_data_energon.py.
- mlperf-logging 4.1 (<5): the compliance checker's `make_checker` and its module-level `enqueued_configs`,
  the checker object's message dictionaries, `rcp_checker.check_directory` and the RCP table beside it. The
  package's public interface is its command line, which prints and exits; `results` needs the verdicts keyed
  by log key. Tests: tests/runs/test_results.py, tests/unit/test_plan.py (the RCP table).
- submitit 1.5: `python -m submitit.core._submit FOLDER`, the module each Slurm task runs to unpickle and call
  the job's function; flux-train runs it inside the container (flux_train/cluster/submit.py), where submitit's own
  command line would run it on the host. Tests: tests/cluster/test_slurm_submit.py.
- submitit 1.5: `JobPaths.get_first_id_independent_folder`, the folder (slurm.folder up to its first `%j`) where
  submitit stages a submission's pickles and batch script; submit removes those of a job sbatch refused
  (flux_train/cluster/submit.py). Tests: tests/cluster/test_submit.py (a refused job),
  tests/cluster/test_slurm_submit.py.
- torch 2.11-2.13: `torch._scaled_mm`, the FP8 GEMM on tensor cores with per-tensor scales, a bias epilogue and
  fast accumulation (flux_train/kernels/fp8.py; torchao calls the same). Tests: tests/gpu/test_gpu.py (GPU),
  tests/unit/test_fp8.py (the CPU emulation it is compared with).
- torch 2.11-2.13: `torch._foreach_copy_`, `torch._foreach_zero_`, one kernel launch for every FP8 layer's amax
  history and scale (flux_train/kernels/fp8.py, inside the graphed step). Tests: tests/unit/test_fp8.py.
- torch 2.11-2.13: `torch.distributed.algorithms._checkpoint.checkpoint_wrapper`, activation checkpointing of
  a block as FSDP2 expects it (flux_train/training/perf.py, parallel.activation_checkpointing). Tests:
  tests/runs/test_parallel.py.
- torch 2.11-2.13: the wrappers' names inside parameter names, `_orig_mod` (torch.compile's OptimizedModule) and
  `_checkpoint_wrapped_module` (checkpoint_wrapper); `canonical_name` drops them, so checkpoints, initial weights
  and exports name parameters alike with and without perf.compile and activation checkpointing
  (flux_train/model/flux.py). Tests: tests/unit/test_parallel.py (compiled blocks keep the checkpoint names),
  tests/runs/test_parallel.py (the activation-checkpointing row).
- torch 2.11-2.13: `nn.Module._parameters`, the dict a module holds its parameters in: ddp puts each parameter's
  view of its bucket's flat weight buffer there in place of the parameter, which leaves the modules and the
  wrappers around them as they are (flux_train/training/ddp.py). Tests: tests/runs/test_parallel.py (the ddp rows),
  tests/runs/test_ddp_reduction.py.
- torch 2.11-2.13: torch-elastic's worker log layout (DefaultLogsSpecs),
  `<log_dir>/<run id>_<random>/attempt_<n>/<local rank>/stderr.log`, where the per-node agent reads a failed
  worker's last stderr lines (flux_train/cluster/launch.py). Tests: tests/cluster/test_launch.py (a failure names the
  rank and the stderr tail).
- torch 2.11-2.13: the elastic agent's INFO record "Rendezvous complete for workers. Result: ...", whose arguments
  are one dict (group_rank, group_world_size, global_ranks, ...), and the format strings of two of its warnings (a
  death signal received, a closing signal sent); the per-node agent says the first in one line of its own and
  drops the others, which repeat its own lines (flux_train/cluster/launch.py, ElasticLog). Tests:
  tests/cluster/test_launch.py (the rendezvous line), tests/cluster/test_slurm_submit.py (each node's group rank).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path


def sbatch_script(command: str, folder: str, **parameters) -> str:
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=command, folder=folder, **parameters)


def split_samples_to_workers(total: int, workers: int) -> list[int]:
    """Sample offsets: global worker i reads samples [offsets[i], offsets[i + 1])."""
    from megatron.energon import WorkerConfig
    from megatron.energon.flavors.webdataset.sharder import Sharder

    return [
        int(o)
        for o in Sharder.split_samples_to_workers(0, total, WorkerConfig(rank=0, world_size=1, num_workers=workers))
    ]


def energon_shard_end(tar: Path) -> int | None:
    """The byte where the last sample of a shard ends, from energon's index beside it; None without one."""
    index = tar.with_name(tar.name + ".idx")
    if not index.is_file():
        return None
    data = index.read_bytes()
    return struct.unpack("Q", data[-8:])[0] if len(data) >= 8 else None  # "Q": as energon packs them


def quiet_energon_sample_errors() -> None:
    """Drop energon's "Except ... in ..." line: the error it announces is re-raised and reported once, by us."""
    from megatron.energon import errors

    def print_but_sample_errors(*args, **kwargs) -> None:
        if not (args and isinstance(args[0], str) and args[0].startswith("Except ")):
            print(*args, **kwargs)

    # a module global named print shadows the builtin inside energon's errors module (it has none of its own)
    errors.print = print_but_sample_errors  # pyright: ignore[reportAttributeAccessIssue] - a new global, on purpose


@dataclass
class CheckerVerdict:
    passed: bool
    by_key: dict[str, str]  # log key -> message
    unkeyed: list[str]
    warnings: list[str]


def compliance_check(log: Path, usage: str, ruleset: str) -> CheckerVerdict:
    """The official compliance checker on one log, in-process (its log lines go to the `logging` module)."""
    from mlperf_logging.compliance_checker import mlp_compliance

    checker = mlp_compliance.make_checker(usage, ruleset, quiet=False, werror=False)
    mlp_compliance.enqueued_configs.clear()  # a module-level queue: a check that raised may have left configs in it
    try:
        passed = checker.check_file(str(log), f"{usage}_{ruleset}/common.yaml")
    except Exception as exc:  # the rule files run code through exec; an odd log can make it raise
        checker.put_message(f"the checker raised {type(exc).__name__}: {exc}")
        passed = False
    return CheckerVerdict(
        passed, dict(checker.overwritable), list(checker.not_overwritable), list(checker.warnings.values())
    )


def rcp_check(folder: Path, usage: str, ruleset: str) -> tuple[bool, str, float]:
    """The RCP checker on a folder of result_<i>.txt logs: (passed, message, speed-up factor)."""
    from mlperf_logging.rcp_checker import rcp_checker

    return rcp_checker.check_directory(str(folder), usage, ruleset, False, False, rcp_pass="pruned_rcps")


def rcp_records(usage: str, ruleset: str, benchmark: str) -> dict[str, dict]:
    """The RCP table beside the checker: {name: {"BS": GBS, "samples to converge": [one per run], ...}}. Read
    without importing the checker module (it imports scipy: seconds)."""
    from importlib.resources import files

    return json.loads(
        (files("mlperf_logging.rcp_checker") / f"{usage}_{ruleset}" / f"rcps_{benchmark}.json").read_text()
    )


def rcp_batch_sizes(usage: str, ruleset: str, benchmark: str) -> list[int]:
    return sorted(record["BS"] for record in rcp_records(usage, ruleset, benchmark).values())
