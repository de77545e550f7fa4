"""Data parallelism on the CPU (gloo, FSDP2): 2 ranks with half the batch each reproduce 1 rank's losses; a
stopped rank ends the run (the layouts' own checks: tests/unit/test_parallel.py)."""

import os
import subprocess

import pytest
from run_outputs import column, metrics, train, train_command

ARGS = [
    "--set",
    "data.source=synthetic",
    "--set",
    "eval.every_steps=3",
    "--set",
    "train.max_steps=6",
    "--set",
    "train.micro_batch_size=4",
    "--set",
    "logging.log_every=1",
    "--set",
    "train.caption_dropout_prob=0.25",
    "--set",
    "eval.target=0.0",
]


def run(out, nproc, extra=()):
    proc = train(out, *ARGS, *extra, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Today's step on one rank: FSDP2, fp32 reduce, clipping as its own pass, micro 2 x accumulation 4."""
    return run(tmp_path_factory.mktemp("one"), 1, ["--set", "train.micro_batch_size=2"])


# the random draws follow the global micro-batch index, so every run splits GBS 8 into the same micro-batches of 2
@pytest.mark.parametrize(
    "nproc,extra",
    [
        (2, ["--set", "parallel.dp_replicate=2"]),  # HSDP: 2 replicas of 1 shard, accumulation 2
        (1, ["--set", "parallel.strategy=ddp"]),  # flat buffers, clipping folded into the AdamW kernel, accumulation 4
        (2, ["--set", "parallel.strategy=ddp"]),  # + one reduce-scatter / all-gather per step after 2 micro-batches
        (2, ["--set", "parallel.strategy=ddp", "--set", "parallel.dp_replicate=2"]),  # + the shard all-reduce
        (1, ["--set", "parallel.activation_checkpointing=true"]),  # each block's forward again in backward
    ],
    ids=["fsdp-hsdp", "ddp-1", "ddp-2", "ddp-hsdp", "activation-checkpointing"],
)
@pytest.mark.slow
def test_layouts_and_rank_counts_match_one_rank(tmp_path, one_rank, nproc, extra):
    """fp32 compute: every layout computes the same step, so losses, grad norms and val losses agree to fp32
    rounding (1e-4 relative over 6 steps)."""
    other = run(tmp_path / "other", nproc, ["--set", "train.micro_batch_size=2", *extra])
    loss1, loss2 = column(one_rank, "loss"), column(other, "loss")
    assert len(loss1) == len(loss2) == 6
    assert loss1[-1] < loss1[0]
    assert loss2 == pytest.approx(loss1, rel=1e-4)
    assert column(other, "grad_norm") == pytest.approx(column(one_rank, "grad_norm"), rel=1e-4)
    # eval: both count the whole val set once and agree on the loss up to the eval noise, which each rank draws
    # for its own share of the val set (16 samples here: well under 2 %)
    val1, val2 = column(one_rank, "val_loss"), column(other, "val_loss")
    assert len(val1) == len(val2) == 2
    assert val2 == pytest.approx(val1, rel=2e-2)
    # each t's loss is reduced with the sum and the count: on 2 ranks (rank 0 holds the val samples of even k, rank 1
    # those of odd k) every t = k/8 is there, 2 samples each, and they average to the val loss
    for row in [r for r in metrics(other) if "val_loss" in r]:
        assert list(row["val_loss_by_t"]) == [str(k / 8) for k in range(8)]
        assert sum(row["val_loss_by_t"].values()) / 8 == pytest.approx(row["val_loss"], rel=1e-12)


@pytest.mark.slow
def test_bf16_ddp_step_tracks_the_fp32_reduce_fsdp_step(tmp_path):
    """bf16 compute: ddp (gradients summed in bf16 on 2 ranks, accumulated in bf16) against FSDP with fp32
    gradient reduction on one rank. Only rounding differs: bf16 has 8 bits of mantissa, so the losses of
    6 steps agree to 2 % and the grad norms to 5 %."""
    bf16 = ["--set", "train.micro_batch_size=2", "--set", "train.compute_dtype=bfloat16"]
    fsdp = run(tmp_path / "fsdp", 1, bf16)
    ddp = run(tmp_path / "ddp", 2, [*bf16, "--set", "parallel.strategy=ddp"])
    assert column(ddp, "loss") == pytest.approx(column(fsdp, "loss"), rel=0.02)
    assert column(ddp, "grad_norm") == pytest.approx(column(fsdp, "grad_norm"), rel=0.05)
    assert column(fsdp, "loss")[-1] < column(fsdp, "loss")[0]


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_timeout_naming_it(tmp_path):
    """SIGSTOP one of two workers: the other's next collective times out after parallel.timeout_s and the run
    ends with exit code 4 and a line naming the silent rank and its host."""
    import signal
    import socket
    import time

    from processes import pid_with_env

    out = tmp_path / "run"
    proc = subprocess.Popen(
        train_command(
            out,
            *ARGS,
            "--set",
            "train.max_steps=100000",
            "--set",
            "eval.enabled=false",
            "--set",
            "parallel.timeout_s=15",
            nproc=2,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "FLUX_TEST_RUN": str(out)},
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and len(metrics(out)) < 3:
            time.sleep(0.5)
        victim = pid_with_env(RANK=1, FLUX_TEST_RUN=out)
        assert victim, "rank 1 not found"
        os.kill(victim, signal.SIGSTOP)
        stopped = time.time()
        output, _ = proc.communicate(timeout=180)
        os.kill(victim, signal.SIGCONT) if os.path.exists(f"/proc/{victim}") else None
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - stopped < 15 + 60
    line = next(line for line in output.splitlines() if "collective failed on rank 0" in line)
    assert f"rank 1 on {socket.gethostname()} has been silent" in line, line
