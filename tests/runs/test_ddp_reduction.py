"""ddp's cross-node gradient sum in the dtype parallel.reduce_dtype names, on 4 gloo ranks."""

import multiprocessing

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from flux_train.config import load_config
from flux_train.model.flux import build_model
from flux_train.training.distributed import build_mesh
from flux_train.training.layout import build_training

WORLD = 4


def crafted(seed: int, numel: int) -> torch.Tensor:
    """Gradient values: bf16 numbers of magnitudes 2^-4..2^4, whose sums need more than bf16's 8 bits
    and fit fp32's 24 (so an fp32 sum is exact in any order)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * 2.0 ** torch.randint(-4, 5, (numel,), generator=g)).bfloat16()


def reduced(reduce_dtype: str, replicate: int, rank: int):
    """[(this rank's summed gradient shard, every rank's crafted gradients over that shard)] per bucket, and the
    bytes of tensor memory the reduction allocated."""
    cfg = load_config(
        "configs/debug.yaml",
        [
            "parallel.strategy=ddp",
            f"parallel.reduce_dtype={reduce_dtype}",
            f"parallel.dp_replicate={replicate}",
            "train.compute_dtype=bfloat16",
        ],
    )
    mesh = build_mesh(cfg.parallel, WORLD, WORLD // replicate, "cpu")
    ddp = build_training(build_model(cfg.model), mesh, cfg.parallel, cfg.train, torch.bfloat16, torch.device("cpu"))
    # a loss linear in the weights: its gradient is the crafted values, exactly
    loss = 0
    full = []
    for bucket in ddp.buckets:
        values = [torch.zeros(bucket.grads.numel(), dtype=torch.bfloat16) for _ in range(WORLD)]
        for p, offset in zip(bucket.params, bucket.offsets):
            for r in range(WORLD):
                values[r][offset : offset + p.numel()] = crafted(100 * r + offset, p.numel())
            loss = loss + (p.float() * values[rank][offset : offset + p.numel()].view(p.shape).float()).sum()
        full.append(values)
    ddp.start_micro_batch(0, 1)
    loss.backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ddp.finish_backward()
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
    span = lambda b: slice(b.shard_start, b.shard_start + b.shard_numel)  # noqa: E731
    shards = [(b.grad_shard, torch.stack([v[span(b)] for v in values])) for b, values in zip(ddp.buckets, full)]
    return shards, allocated


def _worker(rank: int, store_path: str) -> None:
    torch.set_num_threads(1)  # four ranks share the machine's cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        # 4 nodes of 1 GPU: the fp32 sum is the exact sum rounded once, through the static buffer (nothing
        # allocated: a CUDA graph replays it); gloo's bf16 sum rounds each partial sum
        shards, allocated = reduced("float32", WORLD, rank)
        assert allocated == 0
        for result, values in shards:
            assert torch.equal(result, values.double().sum(0).bfloat16())
        shards, _ = reduced("bfloat16", WORLD, rank)
        differ = [(result != values.double().sum(0).bfloat16()).float().mean() for result, values in shards]
        assert min(differ) > 0.1, differ
        # 2 nodes of 2: bf16 reduce-scatter within the node, then the fp32 sum over the nodes' shards
        for result, values in reduced("float32", 2, rank)[0]:
            nodes = values.view(2, 2, -1).double().sum(1).bfloat16()
            assert torch.equal(result, nodes.double().sum(0).bfloat16())
    finally:
        dist.destroy_process_group()


def test_fp32_cross_node_sum_is_the_exact_sum_rounded_once(tmp_path):
    # the ranks fork from a server that imported torch and flux_train once (spawning each costs ~5 s of imports)
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, start_method="forkserver")
