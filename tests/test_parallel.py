"""Data parallelism on the CPU (gloo, FSDP2): 2 ranks with half the batch each reproduce 1 rank's losses."""
import json
import subprocess
import sys

import pytest

from flux_train.config import ParallelConfig
from flux_train.parallel import mesh_shape

ARGS = ["--config", "configs/debug.yaml", "--set", "data.source=synthetic", "--set", "eval.every_steps=3",
        "--set", "train.max_steps=6", "--set", "train.micro_batch_size=4", "--set", "logging.log_every=1",
        "--set", "train.caption_dropout_prob=0.25", "--set", "eval.target=0.0"]


def run(out, nproc, extra=()):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    proc = subprocess.run([*launcher, "-m", "flux_train.train", *ARGS, "--set", f"logging.out_dir={out}", *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("micro,extra", [
    (4, []),  # FSDP over 2 ranks: GBS 8 = micro 4 x 2 ranks (one rank: micro 4 x accumulation 2)
    # HSDP, 2 replicas of 1 shard, micro 2 x accumulation 2 (one rank: accumulation 4); the random draws follow
    # the global micro-batch index, so both runs must split the batch into the same micro-batches
    (2, ["--set", "parallel.dp_replicate=2"]),
], ids=["fsdp", "hsdp-accumulation"])
def test_two_ranks_match_one_rank(tmp_path, micro, extra):
    size = ["--set", f"train.micro_batch_size={micro}"]
    one = run(tmp_path / "one", 1, size)
    two = run(tmp_path / "two", 2, size + extra)
    loss1 = [r["loss"] for r in one if "loss" in r]
    loss2 = [r["loss"] for r in two if "loss" in r]
    assert len(loss1) == len(loss2) == 6
    assert loss1[-1] < loss1[0]
    assert loss2 == pytest.approx(loss1, rel=1e-4)
    norm1 = [r["grad_norm"] for r in one if "grad_norm" in r]
    norm2 = [r["grad_norm"] for r in two if "grad_norm" in r]
    assert norm2 == pytest.approx(norm1, rel=1e-4)
    # eval: both count the whole val set once, and agree on the loss
    val1 = [r["val_loss"] for r in one if "val_loss" in r]
    val2 = [r["val_loss"] for r in two if "val_loss" in r]
    assert len(val1) == len(val2) == 2


@pytest.mark.parametrize("world,local,shard,replicate,expected", [
    (16, 8, -1, -1, (2, 8)),   # default: shard within a node, replicate across nodes
    (8, 8, -1, -1, (1, 8)),
    (16, 8, 16, -1, (1, 16)),  # plain FSDP over everything
    (16, 8, -1, 4, (4, 4)),
])
def test_mesh_shape(world, local, shard, replicate, expected):
    assert mesh_shape(ParallelConfig(dp_shard=shard, dp_replicate=replicate), world, local) == expected


def test_mesh_shape_rejects_mismatch():
    with pytest.raises(ValueError, match="parallel.dp_replicate 2 x parallel.dp_shard 3 != world size 8"):
        mesh_shape(ParallelConfig(dp_shard=3, dp_replicate=2), 8, 8)


def test_compiled_blocks_keep_checkpoint_names_and_initial_weights():
    """Checkpoints move between runs with and without perf.compile: same FQNs, same initial values."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from flux_train.compile import block_wrapper
    from flux_train.config import load_config
    from flux_train.model import build_model, materialize
    from flux_train.parallel import build_mesh, parallelize

    cfg = load_config("configs/debug.yaml")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        states = []
        for wrap in (None, block_wrapper("block")):  # torch.compile wraps lazily: nothing compiles here
            model = build_model(cfg.model)
            parallelize(model, build_mesh(cfg.parallel, 1, 1, "cpu"), cfg.parallel, torch.float32, wrap_block=wrap)
            states.append({k: v.full_tensor() for k, v in get_model_state_dict(materialize(
                model, torch.device("cpu"), seed=5)).items()})
        plain, compiled = states
        assert set(plain) == set(compiled) and not any("_orig_mod" in k for k in compiled)
        assert all(torch.equal(plain[k], compiled[k]) for k in plain)
    finally:
        dist.destroy_process_group()
