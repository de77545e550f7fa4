"""Data parallelism with replicated weights and a sharded optimizer (`parallel.strategy: ddp`).

The layout of the MLPerf submissions (Megatron DDP + distributed optimizer), for GPUs with room for two
compute-dtype copies of the model (141 GB and up): every rank holds the bf16 weights and a bf16 gradient
buffer of the whole model; the fp32 master weights and the AdamW moments are sharded over the `dp_shard`
ranks (a node). Per optimizer step the gradients cross the network once (one reduce-scatter per bucket,
started while backward still runs, plus an all-reduce of the shard across nodes) and the updated weights
once (one all-gather per bucket) -- however many micro-batches the step accumulates. FSDP
(`parallel.strategy: fsdp`) instead gathers the weights twice per micro-batch and reduces every micro-batch:
the layout for 80 GB GPUs.

Eager, `step()` issues each bucket's AdamW update and then its all-gather, which runs on into the next forward
(each block waits for its own bucket). A step captured as a CUDA graph must end with every stream joined, which
would wait for all the gathers there (~2 ms a step at two ranks), so with `defer_updates` the step ends with the
clipping factor and the next forward issues each bucket's update and gather LOOKAHEAD buckets ahead of the block
that needs it. A device flag (`_live`) makes an update apply once however often it is issued: by the replay of
a captured step, and by an evaluation or checkpoint between two replays.

Buckets are the blocks (and one for the embedders + final layer). A bucket is one flat buffer whose slices
are the parameters (and one for their gradients); rank r of the shard group owns the r-th 1/S of every
bucket. Gradients are summed, not averaged, and 1/world joins the clipping factor in the optimizer kernel
(flux_train.kernels.adamw), so clipping costs no pass over the gradients of its own. The reduce-scatter sums
in the buffers' (compute) dtype, the cross-node all-reduce in `cross_dtype` (parallel.reduce_dtype: the
compute dtype unless float32 is asked for; docs/benchmark.md "Gradient reduction precision" measures both).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flux_train.config import TrainConfig
from flux_train.kernels.adamw import adamw_hyper, adamw_step
from flux_train.kernels.fp8 import FP8Linear
from flux_train.model.flux import block_stacks, canonical_name

ALIGN = 128  # elements: every parameter and every rank's slice of a bucket starts 256-byte aligned (bf16)
LOOKAHEAD = 2  # buckets whose update is issued ahead of the block being computed

# torch 2.13 renamed the tensor collectives; the older names are what torch 2.6-2.12 have
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Bucket:
    """Flat weight and gradient buffers of some parameters; `shard` slices are this rank's part."""

    names: list[str]
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    weights: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # allocated by DDP._build_bucket
    grads: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    shard_start: int = 0  # this rank's slice of the bucket: [shard_start, shard_start + shard_numel)
    shard_numel: int = 0
    master_offset: int = 0  # where that slice lives in the flat fp32 master/moment tensors
    waiting: set[int] = field(default_factory=set)  # indices of the params whose gradient this micro-batch still owes
    gather: dist.Work | None = None

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.grads[self.shard_start : self.shard_start + self.shard_numel]

    @property
    def weight_shard(self) -> torch.Tensor:
        return self.weights[self.shard_start : self.shard_start + self.shard_numel]

    def grad_of(self, index: int) -> torch.Tensor:
        """The slice of `grads` that holds parameter `index`'s gradient, in its shape."""
        param, offset = self.params[index], self.offsets[index]
        return self.grads[offset : offset + param.numel()].view(param.shape)


def _bucket_modules(model: nn.Module) -> list[tuple[nn.Module | None, list[tuple[str, nn.Parameter]]]]:
    """[(module whose forward first needs the bucket (None = the model), [(name, param)])], forward order."""
    named = list(model.named_parameters())
    double, single = block_stacks(model)
    blocks = [
        (f"{prefix}.{i}.", block)
        for prefix, stack in (("double_blocks", double), ("single_blocks", single))
        for i, block in enumerate(stack)
    ]
    root = [(n, p) for n, p in named if not canonical_name(n).startswith(("double_blocks.", "single_blocks."))]
    out: list[tuple[nn.Module | None, list[tuple[str, nn.Parameter]]]] = [(None, root)]
    for prefix, block in blocks:
        out.append((block, [(n, p) for n, p in named if canonical_name(n).startswith(prefix)]))
    return out


class DDP:
    """Owns the model's weights, gradients and optimizer state in the layout above.

    Per optimizer step: `begin_step(lr)` (host only), `start_micro_batch(i, n)` before each micro-batch's
    forward, `finish_backward()` after the last backward, then `step()`; the next forward waits for the gathered
    weights by itself. Everything after begin_step is device work a CUDA graph can capture. A
    flux_train.training.layout.Layout."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        tcfg: TrainConfig,
        dtype: torch.dtype,
        device: torch.device,
        cross_dtype: torch.dtype,
        defer_updates: bool = False,
    ):
        self.model = model
        self.tcfg = tcfg
        self.defer_updates = defer_updates  # the update in the next forward (a graphed step; module docstring)
        self.shard_group = mesh["dp_shard"].get_group()
        self.replicate_group = mesh["dp_replicate"].get_group()
        # the master weights and moments are saved as one flat tensor sharded like this
        self.state_mesh = mesh if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
        self.shards = mesh["dp_shard"].size()
        self.world = self.shards * mesh["dp_replicate"].size()
        rank = mesh["dp_shard"].get_local_rank()
        self.buckets: list[Bucket] = []
        self._sinks: list[tuple[FP8Linear, torch.Tensor]] = []  # FP8 layers and their weight's gradient slice
        master_numel = 0
        for index, (module, named) in enumerate(_bucket_modules(model)):
            bucket = self._build_bucket(named, dtype, device, rank, master_numel)
            master_numel += bucket.shard_numel
            self.buckets.append(bucket)
            (model if module is None else module).register_forward_pre_hook(lambda *_, i=index: self._before_forward(i))
        # fp32 master weights and AdamW moments of this rank's slices, one flat tensor each
        self.master = torch.zeros(master_numel, device=device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.hyper = torch.zeros(3, device=device)  # this step's AdamW scalars (kernels.adamw.adamw_hyper)
        # the update the last step computed, applied in the next forward: its AdamW scalars, clipping factor, and
        # whether it is still to be applied (1) on the device
        self._update_hyper = torch.zeros(3, device=device)
        self._update_coef = torch.zeros(1, device=device)
        self._live = torch.zeros(1, dtype=torch.int32, device=device)
        self._issued = len(self.buckets)  # buckets whose pending update has been issued (all: none pending)
        self.steps = 0
        self._first = self._last = True
        self._micro = (0, 1)  # the current micro-batch's index and count
        self._reductions: list[dist.Work] = []
        # a cross-node sum in another dtype goes through one static buffer, a bucket at a time (a CUDA graph
        # replays it)
        self._cross = None
        if self.world > self.shards and cross_dtype != dtype:
            self._cross = torch.zeros(max(b.shard_numel for b in self.buckets), dtype=cross_dtype, device=device)

    def _build_bucket(self, named, dtype, device, rank: int, master_offset: int) -> Bucket:
        bucket = Bucket(names=[canonical_name(n) for n, _ in named])
        numel = 0
        for _, p in named:
            bucket.offsets.append(numel)
            numel = _round_up(numel + p.numel(), ALIGN)
        numel = _round_up(numel, ALIGN * self.shards)
        bucket.weights = torch.zeros(numel, dtype=dtype, device=device)
        bucket.grads = torch.zeros(numel, dtype=dtype, device=device)
        bucket.shard_numel = numel // self.shards
        bucket.shard_start = rank * bucket.shard_numel
        bucket.master_offset = master_offset
        owners = {id(p): (m, k) for m in self.model.modules() for k, p in m._parameters.items() if p is not None}
        for index, ((_, p), offset) in enumerate(zip(named, bucket.offsets)):
            view = nn.Parameter(bucket.weights[offset : offset + p.numel()].view(p.shape))
            module, key = owners[id(p)]
            module._parameters[key] = view
            view.register_post_accumulate_grad_hook(
                lambda param, b=bucket, i=index: self._gradient_arrived(b, i, param)
            )
            bucket.params.append(view)
            if isinstance(module, FP8Linear) and key == "weight":
                self._sinks.append((module, bucket.grad_of(index).view(-1)))
        bucket.waiting = set(range(len(bucket.params)))
        return bucket

    # ---------------------------------------------------------------------------------- initial weights

    @torch.no_grad()
    def assign_weights(self, values) -> None:
        """Full fp32 tensors by name (model.reference_init, or loaded weights) into the weights and this rank's
        master slices; fresh optimizer state."""
        where = {name: (b, o, p) for b in self.buckets for name, o, p in zip(b.names, b.offsets, b.params)}
        for name, full in values:
            bucket, offset, param = where[name]
            full = full.to(self.master.device, torch.float32)
            param.copy_(full)
            self._master_slice(bucket, offset, param.numel(), full.flatten())
        self.steps = 0
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self._live.zero_()
        self._issued = len(self.buckets)

    def _master_slice(self, bucket: Bucket, offset: int, numel: int, values: torch.Tensor) -> None:
        lo = max(offset, bucket.shard_start)
        hi = min(offset + numel, bucket.shard_start + bucket.shard_numel)
        if lo < hi:
            start = bucket.master_offset + lo - bucket.shard_start
            self.master[start : start + hi - lo].copy_(values[lo - offset : hi - offset])

    # ---------------------------------------------------------------------------------- one step

    def start_micro_batch(self, index: int, count: int) -> None:
        if index > 0:  # a gradient missing there would leave the previous step's in its slice
            self._check_arrived(index - 1, count)
        self._first, self._last = index == 0, index == count - 1
        self._micro = (index, count)
        for bucket in self.buckets:
            bucket.waiting = set(range(len(bucket.params)))
        # the first micro-batch's FP8 weight gradients are written into the buckets by their GEMMs; later ones
        # are added to them below
        for layer, sink in self._sinks:
            layer.wgrad_sink = sink if self._first else None

    def _gradient_arrived(self, bucket: Bucket, index: int, param: torch.Tensor) -> None:
        if index not in bucket.waiting:  # a second backward in one micro-batch would count it twice
            raise RuntimeError(f"parameter {bucket.names[index]} received a second gradient in one micro-batch")
        bucket.waiting.remove(index)
        grad = bucket.grad_of(index)
        assert param.grad is not None  # the hook runs once the gradient is accumulated
        if self._first:  # the first micro-batch overwrites: no zeroing pass; an FP8 GEMM may have written it there
            if param.grad.data_ptr() != grad.data_ptr():
                grad.copy_(param.grad)
        else:
            grad.add_(param.grad)
        param.grad = None
        if self._last and not bucket.waiting and self.shards > 1:
            work = _reduce_scatter(
                bucket.grad_shard, bucket.grads, op=dist.ReduceOp.SUM, group=self.shard_group, async_op=True
            )
            self._reductions.append(typing.cast(dist.Work, work))  # async_op: a Work

    def _check_arrived(self, index: int, count: int) -> None:
        missing = [bucket.names[i] for bucket in self.buckets for i in sorted(bucket.waiting)]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise RuntimeError(
                f"parameter {missing[0]}{more} received no gradient in micro-batch {index + 1} of {count}: every "
                "parameter must take part in the loss"
            )

    def finish_backward(self) -> None:
        """After the last micro-batch's backward: every bucket's gradients summed over all ranks, in its shard."""
        self._check_arrived(*self._micro)
        for work in self._reductions:
            work.wait()
        self._reductions.clear()
        if self.world > self.shards:
            self._sum_across_nodes()

    def _sum_across_nodes(self) -> None:
        """All-reduce every bucket's gradient shard over the replicas: in place, or through the cross-dtype buffer
        (the shard converted, summed, rounded back once)."""
        if self._cross is None:
            works = [dist.all_reduce(b.grad_shard, group=self.replicate_group, async_op=True) for b in self.buckets]
            for work in works:
                typing.cast(dist.Work, work).wait()  # async_op: a Work
            return
        for bucket in self.buckets:
            wide = self._cross[: bucket.shard_numel]
            wide.copy_(bucket.grad_shard)
            dist.all_reduce(wide, group=self.replicate_group)
            bucket.grad_shard.copy_(wide)

    def begin_step(self, lr: float) -> None:
        """This step's learning rate and count into the device tensor the optimizer kernels read. Deferred, the
        forward issues the last step's update again: a replayed graph did not tell the host it left one (`_live`
        keeps a second issue from applying it twice)."""
        t = self.tcfg
        if self.defer_updates:
            self._issued = 0
        self.steps += 1
        for i, value in enumerate(adamw_hyper(lr, t.adam_beta1, t.adam_beta2, t.weight_decay, self.steps)):
            self.hyper[i].fill_(value)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Clip by the global gradient norm (returned, pre-clip, a device tensor) and issue the AdamW update with
        the all-gathers, or, deferred, leave it to the next forward (or `wait_params`)."""
        t = self.tcfg
        sq = torch.stack([torch.linalg.vector_norm(b.grad_shard, dtype=torch.float32) for b in self.buckets])
        sq = sq.square().sum()
        if self.shards > 1:
            dist.all_reduce(sq, group=self.shard_group)
        norm = sq.sqrt() / self.world
        self._update_coef.copy_((t.grad_clip_norm / (norm + 1e-6)).clamp(max=1.0) / self.world)
        self._update_hyper.copy_(self.hyper)
        self._live.fill_(1)
        self._issued = 0
        if not self.defer_updates:
            self._issue_updates(len(self.buckets) - 1)
        return norm

    def _issue_updates(self, through: int) -> None:
        """AdamW on this rank's slice and the all-gather of buckets up to `through`, each once per step."""
        t = self.tcfg
        for bucket in self.buckets[self._issued : through + 1]:
            start, n = bucket.master_offset, bucket.shard_numel
            adamw_step(
                self.master[start : start + n],
                self.exp_avg[start : start + n],
                self.exp_avg_sq[start : start + n],
                bucket.grad_shard,
                bucket.weight_shard,
                self._update_coef,
                self._update_hyper,
                self._live,
                beta1=t.adam_beta1,
                beta2=t.adam_beta2,
                eps=t.adam_eps,
            )
            if self.shards > 1:
                bucket.gather = _all_gather(bucket.weights, bucket.weight_shard, group=self.shard_group, async_op=True)
            self._issued += 1
            if self._issued == len(self.buckets):
                self._live.zero_()  # applied: a second issue of it changes nothing

    def _before_forward(self, index: int) -> None:
        """Before bucket `index`'s first module runs: a pending update issued a few buckets ahead, this bucket's
        weights gathered."""
        self._issue_updates(index + LOOKAHEAD)
        self._wait_gather(self.buckets[index])

    def _wait_gather(self, bucket: Bucket) -> None:
        if bucket.gather is not None:
            bucket.gather.wait()
            bucket.gather = None

    def wait_params(self) -> None:
        """Before reading the weights outside a forward (checkpoints, export, the end of the run): the pending
        update applied and gathered."""
        self._issue_updates(len(self.buckets) - 1)
        for bucket in self.buckets:
            self._wait_gather(bucket)

    def after_eval(self) -> None:
        """Nothing: the weights are never sharded."""

    def reset_optimizer(self) -> None:
        """Zero moments and step count, keeping the weights (after warm-up steps with lr 0)."""
        self.wait_params()
        self.steps = 0
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()

    # ---------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """DCP state: the full weights under their names (replicated, written once) and this rank's slices of
        the master weights and moments as one flat tensor sharded over the shard group."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.wait_params()
        placements = [Replicate(), Shard(0)] if self.state_mesh.ndim == 2 else [Shard(0)]
        flat = {
            k: DTensor.from_local(getattr(self, k), self.state_mesh, placements, run_check=False)
            for k in ("master", "exp_avg", "exp_avg_sq")
        }
        model = {name: p for b in self.buckets for name, p in zip(b.names, b.params)}
        return {"model": model, "optim": flat | {"steps": torch.tensor(self.steps)}}

    def load_state_dict(self, state_dict: dict) -> None:
        """After dcp.load filled `state_dict()`'s tensors in place (state_dict applied any pending update first)."""
        self.steps = int(state_dict["optim"]["steps"])
