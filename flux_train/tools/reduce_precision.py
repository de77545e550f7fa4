"""How much a bf16 gradient sum loses against the exact sum, for flux-schnell gradients (docs/benchmark.md,
"Gradient reduction precision").

    python -m flux_train.reduce_precision [--ranks 64] [--keep 262144]    # ~25 min on 2 CPU cores

Every simulated rank computes the gradient of its own micro-batch (own synthetic data, timesteps and noise,
drawn as the trainer draws them) on one model of flux-schnell width: 1 double + 1 single block, hidden 3072,
24 heads of 128, reference init with the zero-initialised weights perturbed so that every gradient is
non-zero. bf16 compute is emulated in fp32 (a CPU has no usable bf16 GEMM): weights, every Linear's input
and output and the gradients flowing back through them hold bf16 values, and each parameter's gradient is
rounded to bf16 once, as a bf16 GEMM with fp32 accumulation stores it.

The sums follow NCCL's ring: the contributions are added one after another and every partial sum is stored
in bf16 (NCCL's bf16 FuncSum is `__hadd`: the exact sum of two bf16 values rounded once). Layouts: `ring` over
all ranks; `node bf16` = a ring within each node of 8 (ddp's reduce-scatter) then a ring over the nodes'
sums (the cross-node all-reduce); `node fp32` = the same node sums, added across nodes in fp32 and rounded to
bf16 once; `once` = the exact sum rounded to bf16 once, the floor of any sum stored in bf16. The reference is
the float64 sum (exact for these addends). To keep memory and time small, each tensor's errors are measured
on a fixed uniform random subset of at most `--keep` of its elements, weighted by numel / kept.

Rank counts beyond the computed gradients (512 by default) come from a random-rounding model (`predicted`)
fitted on them; the table prints it for every count, next to the measurements it can be checked against.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from flux_train.cli import reduce_precision_parser
from flux_train.config import CONFIG_DIR, TrainConfig, load_config
from flux_train.data.sources import synthetic_samples
from flux_train.model import flow
from flux_train.model.flux import FluxModel, build_model, init_rule, materialize

NODE = 8  # ranks per node: ddp's dp_shard group on 8-GPU nodes
TEXT_LEN, LATENT = 256, 32  # 256 text tokens + (32 / 2)^2 = 256 image tokens


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The nearest bf16 value, kept in x's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


class _RoundToBf16(torch.autograd.Function):
    """Rounds the tensor forward and its gradient backward, as a bf16 activation between two ops does."""

    @staticmethod
    def forward(ctx, x):
        return to_bf16(x)

    @staticmethod
    def backward(ctx, grad):  # pyright: ignore[reportIncompatibleMethodOverride] - one output, one gradient
        return to_bf16(grad)


def build(seed: int) -> FluxModel:
    """The two-block flux-schnell-wide model in fp32 holding bf16 values, Linears' inputs/outputs rounded."""
    cfg = load_config(CONFIG_DIR / "model/flux-schnell.yaml", ["model.num_layers=1", "model.num_single_layers=1"])
    model = materialize(build_model(cfg.model, "torch"), torch.device("cpu"), seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                if init_rule(name, module)[0] == "zero":  # adaLN and final projection: no gradient flows at 0
                    module.weight.normal_(0.0, 0.02, generator=g)
                module.register_forward_pre_hook(lambda _, args: tuple(_RoundToBf16.apply(a) for a in args))
                module.register_forward_hook(lambda _, __, out: _RoundToBf16.apply(out))
        for p in model.parameters():
            p.copy_(to_bf16(p))
    return model


def rank_gradient(model: FluxModel, rank: int, seed: int, batch: int, picks: list[torch.Tensor]) -> torch.Tensor:
    """Rank `rank`'s fp32 gradient (bf16 GEMM operands, fp32 accumulation) at the kept elements, concatenated."""
    m = model.cfg
    samples = synthetic_samples(
        batch, TEXT_LEN, LATENT, LATENT, m.joint_attention_dim, m.pooled_projection_dim, seed * 100_003 + rank
    )
    gen = flow.seeded_generator(torch.device("cpu"), seed, 0, rank, flow.STREAM_NOISE)
    t, train = torch.rand(batch, generator=gen), TrainConfig()
    inputs, target = flow.build_inputs(samples, t, gen, train.latent_shift, train.latent_scale, torch.bfloat16)
    kwargs = {k: v.float() for k, v in inputs.as_kwargs().items()}
    model.zero_grad(set_to_none=True)
    flow.mse_loss(model(**kwargs), target).backward()
    return torch.cat([p.grad.flatten()[idx] for p, idx in zip(model.parameters(), picks) if p.grad is not None])


def ring_sum(grads, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A ring's sum: each hop adds its contribution to the partial sum and stores the result in `dtype`, rounded
    once (NCCL's bf16 sum is `__hadd`: the exact sum of two bf16 values, rounded once)."""
    acc = grads[0].to(dtype)
    for g in grads[1:]:
        acc = (acc.double() + g.double()).to(dtype)
    return acc


def two_level(grads: torch.Tensor, cross: torch.dtype) -> torch.Tensor:
    """bf16 ring within each node of NODE ranks, then a ring over the nodes' sums in `cross`, rounded to bf16."""
    nodes = torch.stack([ring_sum(grads[i : i + NODE]) for i in range(0, len(grads), NODE)])
    return ring_sum(nodes, cross).bfloat16()


def errors(result: torch.Tensor, exact: torch.Tensor, per_tensor) -> dict:
    """Relative error of the global norm, the worst tensor's relative error, the fraction of elements that
    differ from the exact sum rounded once to bf16, and the error's component along the exact sum (relative
    to it: a bias shrinking or growing the gradient, where rounding noise gives ~0)."""
    err, ref = result.double() - exact, per_tensor(exact.square())
    err2 = per_tensor(err.square())
    return {
        "rel": float(err2.sum() / ref.sum()) ** 0.5,
        "worst": float((err2[ref > 0] / ref[ref > 0]).max()) ** 0.5,
        "differ": float(per_tensor(result != exact.bfloat16()).sum() / per_tensor(torch.ones_like(exact)).sum()),
        "along": float(per_tensor(err * exact).sum() / ref.sum()),
    }


def measure(grads: torch.Tensor, per_tensor, n: int) -> dict:
    """The errors of each layout over the first n ranks' bf16 gradients, and the sum's own sampling noise:
    sqrt(n) x one micro-batch gradient's spread about their mean, relative to the sum."""
    exact = ring_sum(grads[:n], torch.float64)
    spread = (sum(per_tensor(g.double().square()) for g in grads[:n]) - per_tensor(exact.square()) / n) / (n - 1)
    row = {
        "ranks": n,
        "noise": float(n * spread.sum() / per_tensor(exact.square()).sum()) ** 0.5,
        "once": errors(exact.bfloat16(), exact, per_tensor),
        "ring": errors(ring_sum(grads[:n]), exact, per_tensor),
    }
    if n > NODE:
        row["node bf16"] = errors(two_level(grads[:n], torch.bfloat16), exact, per_tensor)
        row["node fp32"] = errors(two_level(grads[:n], torch.float32), exact, per_tensor)
    return row


def predicted(grads: torch.Tensor, per_tensor, n: int) -> dict:
    """The errors of a random-rounding model for n ranks, fitted per tensor on all the computed gradients:
    every stored partial sum P of k ranks' gradients adds an independent error of norm u·|P| (u: one
    rounding's relative error, measured), and E|P|^2 = k^2·m + k·v (m: the mean gradient's squared norm, v:
    one micro-batch gradient's variance about it)."""
    count = len(grads)
    exact = ring_sum(grads, torch.float64)
    v = (sum(per_tensor(g.double().square()) for g in grads) - per_tensor(exact.square()) / count) / (count - 1)
    m = ((per_tensor(exact.square()) - count * v) / count**2).clamp(min=0)
    u2 = per_tensor((exact.bfloat16().double() - exact).square()) / per_tensor(exact.square())
    p = lambda k: k * k * m + k * v  # noqa: E731
    stored = {"once": p(n), "ring": sum(p(k) for k in range(2, n + 1))}
    if n > NODE:
        intra = n // NODE * sum(p(k) for k in range(2, NODE + 1))
        stored["node bf16"] = intra + sum(p(NODE * j) for j in range(2, n // NODE + 1))
        stored["node fp32"] = intra + p(n)
    row = {"ranks": n, "noise": float(n * v.sum() / p(n).sum()) ** 0.5}
    for layout, sums in stored.items():
        err2 = u2 * sums
        row[layout] = {"rel": float(err2.sum() / p(n).sum()) ** 0.5, "worst": float((err2 / p(n)).max()) ** 0.5}
    return row


LAYOUTS = ["once", "ring", "node bf16", "node fp32"]
COLUMNS = {"rel": ("global", "{:.2e}"), "worst": ("worst tensor", "{:.2e}"), "differ": ("differing", "{:.0%}")}
COLUMNS["along"] = ("along the sum", "{:+.0e}")


def print_table(title: str, rows: list[dict], keys: list[str]) -> None:
    print(f"{title}\nranks | sampling noise | {' | '.join(LAYOUTS)}  (each: {' / '.join(COLUMNS[k][0] for k in keys)})")
    for r in rows:
        cells = [" / ".join(COLUMNS[key][1].format(r[k][key]) for key in keys) if k in r else "= ring" for k in LAYOUTS]
        print(f"{r['ranks']} | {r['noise']:.3f} | " + " | ".join(cells))


def element_sample(params: list[torch.Tensor], keep: int, seed: int):
    """(the kept elements of each tensor: all of a small one, a uniform random subset of a large one;
    per_tensor(x): for x over the kept elements, each tensor's estimated sum of x over all its elements)."""
    g = torch.Generator().manual_seed(seed)
    picks = [
        torch.arange(p.numel()) if p.numel() <= keep else torch.randint(p.numel(), (keep,), generator=g).unique()
        for p in params
    ]
    tensor = torch.cat([torch.full((len(i),), t) for t, i in enumerate(picks)])
    weight = torch.cat([torch.full((len(i),), p.numel() / len(i), dtype=torch.float64) for p, i in zip(params, picks)])
    return picks, lambda x: torch.zeros(len(picks), dtype=torch.float64).index_add_(0, tensor, weight * x)


def main(argv=None) -> int:
    args = reduce_precision_parser().parse_args(argv)
    model = build(args.seed)
    picks, per_tensor = element_sample(list(model.parameters()), args.keep, args.seed)
    start = time.perf_counter()
    grads, single = [], 0.0
    for rank in range(args.ranks):
        g32 = rank_gradient(model, rank, args.seed, args.batch, picks)
        grads.append(g32.bfloat16())
        rounding = (grads[-1].double() - g32.double()).square()
        single += float(per_tensor(rounding).sum() / per_tensor(g32.double().square()).sum()) ** 0.5 / args.ranks
        print(f"rank {rank + 1}/{args.ranks}: {time.perf_counter() - start:.0f} s", flush=True)
    grads = torch.stack(grads)
    print(f"one micro-batch's gradient rounded to bf16: relative error {single:.2e}")
    counts = [2**i for i in range(1, 10)]  # 2 .. 512
    measured = [measure(grads, per_tensor, n) for n in counts if n <= args.ranks]
    print_table("measured", measured, ["rel", "worst", "differ", "along"])
    print_table(
        f"model fitted on {args.ranks} ranks", [predicted(grads, per_tensor, n) for n in counts], ["rel", "worst"]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
