"""`python -m flux_train.plan`: the RCP arithmetic against the shipped RCP table, the memory model against the ddp
layout's real buffers and the measured peaks, and the plan as submit uses it. Checkpoint disk against a checkpoint
the trainer writes, and pre-flight's disk floor from it: tests/runs/test_plan.py."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import mlperf_logging
import pytest
import torch

from flux_train.cluster import submit as sub
from flux_train.config import EVAL_SAMPLES, load_config
from flux_train.model.flux import (
    build_model,
    count_params,
    flops_per_sample,
    largest_block_param_count,
    token_linear_param_count,
)
from flux_train.tools import plan
from flux_train.training.ddp import DDP

H200 = "configs/systems/H200_01x08.yaml"
H100 = "configs/systems/H100_01x08.yaml"
RCP_FILE = Path(mlperf_logging.__file__).parent / "rcp_checker" / "training_6.0.0" / "rcps_flux1.json"


def plan_json(capsys, tmp_path, *args: str) -> dict:
    assert plan.main([*args, "--json", "--png", str(tmp_path / "plan.png")]) == 0
    return json.loads(capsys.readouterr().out)


def rcp_samples(gbs: int) -> list[int]:
    return next(r["samples to converge"] for r in json.loads(RCP_FILE.read_text()).values() if r["BS"] == gbs)


def test_time_to_train_from_the_rcp_of_the_gbs(capsys, tmp_path):
    """GBS 2048 (the MI325X system) at a stated rate, no checkpoints and no eval rate for MI325X: time-to-train is
    the RCP's samples over the rate of 64 GPUs, for the mean and both ends of the range."""
    samples = rcp_samples(2048)
    out = plan_json(
        capsys,
        tmp_path,
        *("--config", "configs/systems/MI325X_08x08x32.yaml", "--gpu", "MI325X", "--rate", "33"),
        *("--set", "checkpoint.every_steps=0"),
    )
    assert out["rcp"]["runs"] == len(samples) == 20
    assert out["rcp"]["mean"] == pytest.approx(sum(samples) / len(samples))  # 10.35 M
    assert (out["rcp"]["low"], out["rcp"]["high"]) == (min(samples), max(samples))
    t = out["plans"][0]["time_to_train"]
    for key, value in (("mean", sum(samples) / len(samples)), ("low", min(samples)), ("high", max(samples))):
        assert t[f"{key}_min"] == pytest.approx(value / (33 * 64) / 60)
    assert out["plans"][0]["lower_bound"]  # no eval rate for MI325X: the time is a lower bound, and says so


@pytest.mark.parametrize("system", sorted(Path("configs/systems").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_system_plans_as_shipped(system, capsys, tmp_path):
    """Each file of configs/systems/ as a user plans it, with no flag but --png: the GPU systems print their plan,
    with `-` where a figure is missing (not `>=-`, not a warm-up of 0.0 s); a kind with nothing measured (the AMD
    systems) says so in one line with the bench commands that measure it. The CPU system is refused in one line:
    there is no GPU kind to plan for."""
    code = plan.main(["--config", str(system), "--png", str(tmp_path / "plan.png")])
    out, err = capsys.readouterr()
    if load_config(system).train.device == "cpu":
        assert code == 2 and err.startswith("plan: name the GPU kind") and len(err.splitlines()) == 1, err
        return
    assert code == 0, err
    assert ">=-" not in out and "(0.0 s)" not in out and (tmp_path / "plan.png").is_file()
    kind = load_config(system).preflight.gpu_name
    missing = [line for line in out.splitlines() if line.startswith("missing")]
    if plan.Figures(kind).measured:
        assert missing == ["missing (times that need them are lower bounds, marked >=):"] or missing == [], missing
    else:
        assert missing == [
            f"missing: nothing is measured on {kind} yet, so no step, time-to-train or checkpoint time: on one "
            f"{kind} node run `python -m flux_train.bench --rows ours --json {kind}.jsonl` and `torchrun --standalone "
            f"--nproc_per_node=8 -m flux_train.bench --mode step --config {system} --rows ours --profile --json "
            f"{kind}.jsonl`, then plan with --measured {kind}.jsonl (or add its rows to measured.yaml)"
        ]


def test_a_gbs_without_rcp_is_refused_naming_the_ones_with(capsys, tmp_path):
    sizes = sorted(r["BS"] for r in json.loads(RCP_FILE.read_text()).values())
    assert plan.main(["--config", H200, "--set", "train.global_batch_size=768", "--png", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("plan: GBS 768 has no reference convergence point")
    assert ", ".join(map(str, sizes)) in err
    assert not (tmp_path / "p.png").exists()


def test_node_counts_no_run_can_use_are_refused_at_once_and_the_largest_usable_range_is_answered(capsys, tmp_path):
    """`--nodes 1-1000000` (a typo away from 1-100) printed nothing for minutes: past one sample per GPU no node count
    can train, so such a range is refused in one line; the largest range a GBS can use (4096 samples on one GPU per
    node) is answered within 10 s, every count that does not split the batch in a row of its own."""
    png = tmp_path / "p.png"
    t0 = time.perf_counter()
    assert plan.main(["--config", "configs/systems/H200_08x08.yaml", "--nodes", "1-1000000", "--png", str(png)]) == 2
    assert time.perf_counter() - t0 < 10
    assert capsys.readouterr().err == (
        "plan: --nodes 1000000: GBS 1024 gives 8 GPUs per node one sample each at 128 nodes; give node counts up to "
        "128\n"
    )
    assert not png.exists()
    t0 = time.perf_counter()
    argv = ["--config", H200, "--set", "train.global_batch_size=4096", "--gpus-per-node", "1", "--nodes", "1-4096"]
    assert plan.main([*argv, "--png", str(png)]) == 0
    assert time.perf_counter() - t0 < 10
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if re.match(r"\s*\d+ +\d+ ", line)]
    assert rows == [str(n) for n in range(1, 4097)]
    assert png.is_file()


class _Group:
    def __init__(self, size: int):
        self.n = size

    def size(self) -> int:
        return self.n

    def get_group(self):
        return None

    def get_local_rank(self) -> int:
        return 0


@pytest.mark.parametrize("gpus", [2, 8])
def test_ddp_memory_model_is_the_layouts_buffers(gpus):
    """flux-schnell's 11,891,178,560 parameters in the real ddp layout (built on the meta device, rank 0 of a node
    of `gpus`): its weight and gradient buffers and fp32 master and moments are the plan's model state."""
    cfg = load_config(H200, [f"slurm.gpus_per_node={gpus}"])
    model = build_model(cfg.model)
    assert count_params(model) == 11_891_178_560
    mesh = {"dp_shard": _Group(gpus), "dp_replicate": _Group(1)}
    ddp = DDP(model, mesh, cfg.train, torch.bfloat16, torch.device("meta"), torch.bfloat16)
    held = sum(b.weights.nbytes + b.grads.nbytes for b in ddp.buckets)
    held += ddp.master.nbytes + ddp.exp_avg.nbytes + ddp.exp_avg_sq.nbytes
    assert plan.memory(cfg, plan.Figures("H200"), plan.Notes())["state_gib"] * 2**30 == pytest.approx(held, rel=1e-3)


def test_projection_against_the_measured_steps(capsys, tmp_path):
    """Each 2-GPU full-model configuration measured on H200, projected from the other configurations' rows: peak
    memory (from the one-GPU forward+backward rows only) within 2 %, the ddp step within 10 %; fsdp with
    checkpointing at 32 x 4 too. Micro-batch 4 holds
    the two terms the per-sample fit alone got wrong: our FP8 keeps every transposed e4m3 weight for the backward
    (fitted per sample: 3.8 % low), and batch-4 rows peak at the weights and their gradients (counted as
    activations: bf16 at micro-batch 8 5.5 % high)."""
    checked = plan_json(capsys, tmp_path, "--config", H200, "--check")
    two = [r for r in checked if r["gpus"] == 2 and r["blocks"] == [19, 38]]
    assert {r["layout"] for r in two} == {
        "ddp bf16", "ddp fp8 tensorwise (torchao)", "fsdp bf16", "ddp bf16, eager", "ddp fp8 delayed, eager",
        "ddp fp8 delayed, graphs", "fsdp bf16 + AC, eager", "fsdp fp8 delayed + AC, eager",
    }  # fmt: skip
    assert {r["micro_batch"] for r in two} == {4, 8, 32}
    for r in two:
        assert r["projected_peak_gib"] == pytest.approx(r["measured_peak_gib"], rel=0.02), r
        if r["layout"].startswith("ddp"):
            assert r["projected_samples_s_per_gpu"] == pytest.approx(r["measured_samples_s_per_gpu"], rel=0.10), r


def test_a_checkpointed_fsdp_step_peaks_with_its_gradient_shards_and_largest_block_held(capsys, tmp_path):
    """fsdp with activation checkpointing (6 + 12 blocks on two H200, FP8 at 32 x 4 and 128 x 1): the peak comes late
    in the backward, where every block's fp32 gradient shard is written, also at one micro-batch a step, and FSDP
    holds its largest block (a double block, 339.8 M parameters) gathered, the next one prefetched, and its gradient
    unsharded twice. Counted, each peak within 3 % (the shards left out at 128 x 1: 19.5 % low; two average blocks
    instead of the largest four times at 32 x 4: 7.4 % low)."""
    assert largest_block_param_count(load_config(H200).model) == 339_831_296
    checked = plan_json(capsys, tmp_path, "--config", H200, "--check")
    rows = [r for r in checked if r["blocks"] == [6, 12] and r["layout"].startswith("fsdp")]
    assert {(r["micro_batch"], r["accumulation"]) for r in rows} == {(32, 4), (128, 1)}
    for row in rows:
        assert row["projected_peak_gib"] == pytest.approx(row["measured_peak_gib"], rel=0.03), row


def test_four_rank_steps_with_and_without_activation_checkpointing(capsys, tmp_path):
    """The whole model on 4 H100 under fsdp, each configuration projected from the others' rows: micro-batch 8 x 2
    (communication-bound) and 32 x 4 with activation checkpointing (compute-bound: every block's forward runs again,
    and only each block's input is kept), bf16 and FP8 delayed. The step within 10 %, the peak within 5 % (FP8
    without the e4m3 weight copies fsdp no longer keeps), none a lower bound (the 4-GPU collectives' bandwidth is
    measured)."""
    checked = plan_json(capsys, tmp_path, "--config", H100, "--check")
    four = [r for r in checked if r["gpus"] == 4]
    assert {(r["micro_batch"], r["accumulation"], r["layout"]) for r in four} == {
        (8, 2, "fsdp bf16, eager"), (8, 2, "fsdp fp8 delayed, eager"), (32, 4, "fsdp bf16 + AC, eager"),
        (32, 4, "fsdp fp8 delayed + AC, eager"),
    }  # fmt: skip
    for r in four:
        assert r["projected_samples_s_per_gpu"] == pytest.approx(r["measured_samples_s_per_gpu"], rel=0.10), r
        assert r["projected_peak_gib"] == pytest.approx(r["measured_peak_gib"], rel=0.05), r
        assert not r["step_lower_bound"], r


def test_fp8_weight_copies_are_ddp_state_and_a_recomputed_block_s():
    """Our FP8's transposed e4m3 weights (one byte per FP8 parameter) stay from the forward to the backward under ddp;
    fsdp's backward casts the weights it gathers again (FP8Linear.recast_weight); with activation checkpointing,
    either layout keeps those of the block being recomputed (a block's at a time)."""

    def state(*overrides: str) -> float:
        cfg = load_config(H100, ["slurm.gpus_per_node=4", *overrides])
        return plan.memory(cfg, plan.Figures("H100"), plan.Notes())["state_gib"] * 2**30

    copies = token_linear_param_count(load_config(H100).model)
    fsdp, ddp, ac = "parallel.strategy=fsdp", "parallel.strategy=ddp", "parallel.activation_checkpointing=true"
    assert state(fsdp, "perf.fp8=delayed") == state(fsdp)
    assert state(ddp, "perf.fp8=delayed") - state(ddp) == pytest.approx(copies)
    for layout in (ddp, fsdp):
        assert state(layout, ac, "perf.fp8=delayed") - state(layout, ac) == pytest.approx(copies / (19 + 38))


def test_measured_rows_come_first_and_are_named(capsys, tmp_path):
    """A bench rows file's forward+backward row is used ahead of the table's: twice the rate, half the compute."""
    base = plan_json(capsys, tmp_path, "--config", H200)["plans"][0]
    tabled = float(re.search(r"bf16 fwdbwd ([\d.]+) samples/s", base["sources"]["compute"])[1])
    rows = tmp_path / "rows.jsonl"
    fast = {"mode": "fwdbwd", "row": "ours", "batch": 16, "precision": "bf16", "samples_s_per_gpu": 2 * tabled,
            "peak_gib": 76.5, "blocks": [19, 38], "device": "NVIDIA H200"}  # fmt: skip
    rows.write_text(json.dumps({"mode": "fwdbwd", "row": "stock", "batch": 16}) + "\n" + json.dumps(fast) + "\n")
    faster = plan_json(capsys, tmp_path, "--config", H200, "--measured", str(rows))["plans"][0]
    assert faster["step"]["compute_s"] == pytest.approx(base["step"]["compute_s"] / 2, rel=0.01)
    assert f"{rows} row 2" in faster["sources"]["compute"]


def test_submit_dry_run_prints_the_plan_line(capsys, tmp_path):
    argv = ["--config", H200, "--dry-run", "--set", f"slurm.folder={tmp_path}/%j", "--set", "checkpoint.keep=4"]
    assert sub.main(argv) == 0
    line = capsys.readouterr().out.splitlines()[0]
    params = count_params(build_model(load_config(H200).model))
    assert line.startswith("# plan (H200 x 8, ddp bf16, micro-batch 16): fits") and "time-to-train" in line
    assert f"checkpoint disk {5 * params * 14 / 1e9:.0f} GB" in line  # bf16 weights + fp32 master and moments, x 5


def test_a_signal_too_close_to_the_limit_for_the_checkpoint_it_asks_for_is_warned_with_what_to_set(capsys, tmp_path):
    """One node of 8 H200 writes its 166.5 GB at the 0.46 GB/s measured: Slurm's warning at the default 120 s before
    the limit would cut that save; the warning's own advice silences it."""
    argv = ["--config", H200, "--dry-run", "--set", f"slurm.folder={tmp_path}/%j"]
    assert sub.main(argv) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "slurm.signal_delay_s=120" in line]
    assert len(warned) == 1 and warned[0].startswith("submit: warning:") and "166 GB save" in warned[0]
    advised = re.search(r"set it to (\d+) or more", warned[0])
    assert advised and int(advised.group(1)) > 1.2 * 166.5 / 0.46
    assert sub.main([*argv, "--set", f"slurm.signal_delay_s={advised.group(1)}"]) == 0
    assert "signal_delay_s" not in capsys.readouterr().err


def test_submit_refuses_a_job_that_cannot_fit_and_names_what_would(capsys, tmp_path):
    """2 H200 per node: ddp at micro-batch 8 was measured at 137.9 GiB and failed in NCCL; the plan refuses it and
    16, and what it proposes is accepted."""
    argv = ["--config", H200, "--dry-run", "--gpus-per-node", "2", "--set", f"slurm.folder={tmp_path}/%j"]
    for mb in (16, 8):
        assert sub.main([*argv, "--set", f"train.micro_batch_size={mb}"]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            len(err.splitlines()) == 1 and err.startswith("plan: ddp bf16 at micro-batch") and "what fits: --set" in err
        )
    fix = shlex.split(err.split("what fits: --set ", 1)[1].split(" (", 1)[0])
    assert sub.main([*argv, *[a for f in fix for a in ("--set", f)]]) == 0
    assert "fits" in capsys.readouterr().out.splitlines()[0]


def test_eval_rate_of_another_depth_carries_over_at_its_flop_rate(capsys, tmp_path):
    """An eval rate measured at 6 + 12 blocks is not the 12B model's: the plan takes it at the row's FLOP rate (an
    eval is one forward per sample), so the full model's evals take flops(19+38)/flops(6+12) times as long."""
    eval_rate = 300.0
    rows = tmp_path / "rows.jsonl"
    step = {"mode": "step", "row": "ours", "world": 2, "batch": 8, "accum": 1, "strategy": "ddp", "precision": "bf16",
            "samples_s_per_gpu": 60.0, "eval_samples_s_per_gpu": eval_rate, "blocks": [6, 12],
            "device": "NVIDIA H200"}  # fmt: skip
    rows.write_text(json.dumps(step) + "\n")
    got = plan_json(capsys, tmp_path, "--config", H200, "--measured", str(rows))["plans"][0]
    cfg = load_config(H200)
    small = load_config(H200, ["model.num_layers=6", "model.num_single_layers=12"])
    scaled = eval_rate * flops_per_sample(small.model, 256, 256) / flops_per_sample(cfg.model, 256, 256)
    assert scaled == pytest.approx(eval_rate / 3.16, rel=0.01) and got["gpus"] == 8  # 19+38 blocks: 3.16x the FLOPs
    assert got["time_to_train"]["eval_s"] == pytest.approx(EVAL_SAMPLES / (scaled * got["gpus"]), rel=1e-6)
    assert "at their FLOP rate" in got["sources"]["eval"] and f"{rows} row 1" in got["sources"]["eval"]


def test_check_projects_graphed_and_eager_steps_apart(capsys, tmp_path):
    """Graphed and eager step rows of one configuration are checked apart (FP8's eager step waits on the host,
    which the projection does not model); the graphed ones, what perf.cuda_graphs=auto runs with FP8, within 10 %."""
    checked = plan_json(capsys, tmp_path, "--config", H200, "--check")
    fp8 = [r for r in checked if r["blocks"] == [6, 12] and r["micro_batch"] == 8 and "fp8" in r["layout"]]
    for gpus in (1, 2):
        rows = {r["layout"]: r for r in fp8 if r["gpus"] == gpus}
        assert set(rows) == {"ddp fp8 delayed, graphs", "ddp fp8 delayed, eager"}, (gpus, list(rows))
        graphed = rows["ddp fp8 delayed, graphs"]
        assert graphed["projected_samples_s_per_gpu"] == pytest.approx(graphed["measured_samples_s_per_gpu"], rel=0.1)
