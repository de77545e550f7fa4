"""The precision component in the trainer's runs: a checkpoint restores FP8's amax histories exactly (also from a
checkpoint written before the parts had names); the debug model trains under every recipe and impl as it does
without FP8 (the CPU emulation), and FP8 at two gloo ranks, fsdp and ddp, as at one. The component itself:
tests/unit/test_precision.py; the GPU variants: tests/gpu/test_gpu.py."""

import math
from pathlib import Path

import pytest
import torch
from run_outputs import column, set_flags, train

from flux_train.config import load_config
from flux_train.training import distributed
from flux_train.training.precision import DelayedFP8
from flux_train.training.train import Trainer, main


def run_config(out: Path, *sets: str):
    return load_config(
        "configs/debug.yaml",
        ["data.source=synthetic", "eval.enabled=false", f"logging.out_dir={out}", "logging.progress_bar=false", *sets],
    )


def finished(trainer: Trainer) -> Trainer:
    """`trainer` run to its end and torn down as the train command does."""
    try:
        trainer.run()
    finally:
        trainer.heartbeat.stop()
        trainer.close()
        distributed.shutdown()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("written", ["with parts", "before the parts had names", "with another history length"])
def test_a_resumed_fp8_run_restores_the_amax_histories_it_saved_exactly(tmp_path, capsys, written):
    """FP8 delayed scaling's histories and overflow count come back bit for bit from the `precision` part of a
    checkpoint, or from progress.pt's `fp8` in a checkpoint written before the parts had names; after the warm-up,
    which would reset them. A run with another perf.fp8_amax_history says the checkpoint's do not fit and starts
    from no history."""
    fp8 = ["perf.fp8=delayed", "perf.fp8_amax_history=4", "train.max_steps=5", "checkpoint.every_steps=5"]
    first = finished(Trainer(run_config(tmp_path / "first", *fp8)))
    saved = first.precision.state_dict()
    assert saved["history"].any() and saved["overflows"] > 0
    path = tmp_path / "first" / "checkpoints" / "step_00000005"
    if written == "before the parts had names":  # what the trainer wrote then: the scales' state in progress.pt
        progress = torch.load(path / "progress.pt", weights_only=True)
        del progress["parts"]
        progress["fp8"] = {"history": saved["history"], "overflows": saved["overflows"]}
        torch.save(progress, path / "progress.pt")
        (path / "precision_rank0.pt").unlink()
    length = "8" if written == "with another history length" else "4"
    again = [*fp8, f"perf.fp8_amax_history={length}", f"checkpoint.resume={path}", "perf.warmup_iters=1"]
    second = finished(Trainer(run_config(tmp_path / "second", *again)))
    restored = second.precision.state_dict()
    assert second.state.step == 5
    if length == "8":
        assert not restored["history"].any() and restored["overflows"] == 0
        assert f"checkpoint {path}: its precision state does not fit this run (FP8 amax history of shape " in (
            capsys.readouterr().err
        )
        return
    assert torch.equal(restored["history"], saved["history"]) and torch.equal(restored["overflows"], saved["overflows"])
    assert isinstance(first.precision, DelayedFP8) and isinstance(second.precision, DelayedFP8)
    assert all(torch.equal(a, b) for a, b in zip(second.precision.scaling.scales, first.precision.scaling.scales))


DEBUG_20 = ["data.source=synthetic", "eval.enabled=false", "train.max_steps=20", "logging.log_every=1"]


def debug_losses(out: Path, *sets: str) -> list[float]:
    """The losses of 20 steps of `python -m flux_train.train --config configs/debug.yaml` (fp32 compute), in this
    process (the synthetic source), with `sets`; the run ends at its step cap, status aborted (exit 0)."""
    argv = ["--config", "configs/debug.yaml", *set_flags([*DEBUG_20, f"logging.out_dir={out}", *sets])]
    assert main(argv) == 0
    return column(out, "loss")


@pytest.fixture(scope="module")
def without_fp8(tmp_path_factory) -> list[float]:
    return debug_losses(tmp_path_factory.mktemp("none"), "checkpoint.final=false")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fp8,impl",
    [
        ("delayed", "ours"),
        ("tensorwise", "ours"),
        ("rowwise", "ours"),
        ("tensorwise", "torchao"),
        ("rowwise", "torchao"),
    ],
)
def test_the_debug_model_trains_under_every_fp8_recipe_as_it_does_without(tmp_path, without_fp8, fp8, impl):
    """The debug run a user tries first, 20 steps on the CPU (each FP8 GEMM emulated: the e4m3 values and scales the
    GPU's would take, multiplied in fp32): every loss finite and within 1 % of the run without FP8 (measured:
    0.3 % at most)."""
    losses = debug_losses(tmp_path, f"perf.fp8={fp8}", f"perf.fp8_impl={impl}", "checkpoint.final=false")
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(without_fp8, rel=1e-2)


# the layouts' parity runs (tests/runs/test_parallel.py) with FP8 delayed scaling: its maxima are all-reduced over the
# ranks
PARITY = ["data.source=synthetic", "eval.enabled=false", "train.max_steps=6", "train.micro_batch_size=2"]
PARITY += ["logging.log_every=1", "perf.fp8=delayed", "checkpoint.final=false"]


def parity_run(out: Path, nproc: int, *sets: str) -> Path:
    proc = train(out, *set_flags([*PARITY, *sets]), nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fp8_one_rank(tmp_path_factory) -> Path:
    """FSDP2 on one rank, micro-batch 2 x accumulation 4, FP8 delayed scaling."""
    return parity_run(tmp_path_factory.mktemp("fp8_one"), 1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_fp8_delayed_at_two_ranks_computes_the_losses_of_one_rank(tmp_path, fp8_one_rank, strategy):
    """Two gloo ranks with half the micro-batches each (ddp: the weight gradients of the first written into the
    buckets by the FP8 GEMMs) scale with the maxima of the whole step, so they cast as one rank does: the losses and
    gradient norms of 6 steps agree to fp32 rounding."""
    other = parity_run(tmp_path / "two", 2, f"parallel.strategy={strategy}")
    assert len(column(other, "loss")) == 6
    assert column(other, "loss") == pytest.approx(column(fp8_one_rank, "loss"), rel=1e-4)
    assert column(other, "grad_norm") == pytest.approx(column(fp8_one_rank, "grad_norm"), rel=1e-4)
    assert column(other, "fp8_overflows")[-1] > 0
