"""The training command without a run: a bad config, an out-of-memory (raised in place of a GPU), the progress
bar's times. The debug run end to end: tests/runs/test_train_debug.py."""

import os

import pytest
import torch

from flux_train.config import load_config
from flux_train.training.metrics import Eta, eta_goals
from flux_train.training.train import main


def test_bad_config_exits_2_with_one_message(tmp_path, capsys):
    rc = main(["--config", "configs/debug.yaml", "--set", "train.micro_batch_size=3"])
    assert rc == 2
    assert "train.global_batch_size 8 is not divisible by train.micro_batch_size 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        # NCCL's own allocations fail inside a collective (seen on 2 H200 with the ddp layout at 137.9 GiB)
        torch.distributed.DistBackendError(
            "NCCL error: unhandled cuda error ... Failed to CUDA calloc async 1216 bytes"
        ),
    ],
)
def test_out_of_memory_ends_in_one_line_naming_the_fix(monkeypatch, capsys, tmp_path, error):
    """An out-of-memory anywhere in the run is one line with what to change, exit 5 (raised here in place of the
    GPU that CI does not have)."""
    from flux_train.training import train as train_module

    def run(self):
        raise error

    monkeypatch.setattr(train_module.Trainer, "run", run)
    code = train_module.main(
        ["--config", "configs/debug.yaml", "--set", "data.source=synthetic", "--set", f"logging.out_dir={tmp_path}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == train_module.EXIT_OUT_OF_MEMORY and len(err) == 1
    assert err[0].startswith("out of GPU memory on rank 0") and "train.micro_batch_size" in err[0]


def test_a_loader_worker_s_fd_sharing_cut_by_ctrl_c_prints_nothing_after_the_one_line(monkeypatch, tmp_path):
    """After Ctrl-C, a loader worker whose peer vanished while it handed over a tensor's file descriptor reports the
    reset through sys.excepthook from multiprocessing's resource sharer thread (a 20-line traceback after the run's
    one line, seen in a whole test run). main sets a hook before the workers fork that drops exactly those; any
    other error reported that way still reaches the hook. The reset here is real: a peer that connects to this
    process's resource sharer and closes without reading its challenge."""
    import socket
    import sys
    import threading
    from multiprocessing import resource_sharer

    from flux_train.training import train as train_module

    reported: list[type] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, traceback: reported.append(kind))
    monkeypatch.setattr(train_module.Trainer, "run", lambda self: train_module.Status.SUCCESS)

    def vanishing_peer() -> None:
        """One connection the sharer's thread finds reset, then one it serves: handled in turn, so the first one's
        report is in once the second returns."""
        read, write = os.pipe()
        handed = resource_sharer.DupFd(read)
        with socket.socket(socket.AF_UNIX) as peer:
            peer.connect(resource_sharer._resource_sharer._address)
        os.close(handed.detach())
        os.close(read), os.close(write)

    vanishing_peer()
    assert reported and issubclass(reported[-1], (BrokenPipeError, ConnectionResetError)), reported
    reported.clear()
    code = train_module.main(
        ["--config", "configs/debug.yaml", "--set", "data.source=synthetic", "--set", f"logging.out_dir={tmp_path}"]
    )
    vanishing_peer()
    assert code == 0 and reported == []

    def elsewhere() -> None:  # the same error, raised outside the resource sharer, reported the way it reports
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            sys.excepthook(*sys.exc_info())

    thread = threading.Thread(target=elsewhere)
    thread.start(), thread.join()
    assert reported == [ConnectionResetError]


def test_the_eta_counts_down_to_the_next_eval_and_where_the_reference_converged():
    """The bar's times: to the next eval, and to the eval where the MLPerf reference runs converged at this GBS (their
    mean, then their latest), then to the step cap; the debug flavor has no reference, only the cap. Evals count in."""
    assert eta_goals(load_config("configs/debug.yaml"), 25) == [(600, "step cap")]
    assert eta_goals(load_config("configs/systems/H200_01x08.yaml"), 512) == [  # GBS 512: an eval every 512 steps
        (14336, "RCP mean (7.24 M samples)"),
        (14848, "RCP max (7.60 M samples)"),
        (30000, "step cap"),
    ]
    # evals off (eval.enabled=false): no eval can end the run where the reference converged, only the cap
    assert eta_goals(load_config("configs/systems/H200_01x08.yaml"), 0) == [(30000, "step cap")]
    eta = Eta(25, [(600, "step cap")])
    assert eta.text(150) == ""  # nothing measured yet
    eta.step_s = 0.2
    assert eta.text(150) == "next eval in 00:05, step cap in >01:30"  # evals to come, not measured yet
    eta.eval_s = 1.0
    assert eta.text(160) == "next eval in 00:03, step cap in 01:46"  # 440 steps and 18 evals
    eta = Eta(512, eta_goals(load_config("configs/systems/H200_01x08.yaml"), 512))
    eta.step_s, eta.eval_s = 2.5, 60.0
    assert eta.text(14336) == "next eval in 21:20, RCP max (7.60 M samples) in 22:20"  # past the mean: the max
    assert eta.text(14848).endswith("step cap in 11:00:20")  # past the max: the cap
