"""`python -m flux_train.bench --table`: rows a device run wrote (--json) become the table, the ratios to the
stock row of the same mode and batch, the step efficiency and, for profiled rows, the time by kind and the top
kernels. The rows' measuring needs a GPU (tests/gpu_check.sh); this is the part every host runs."""

import json

import pytest
import torch

from flux_train.config import load_config
from flux_train.model.diffusers_adapter import diffusers_inputs
from flux_train.tools import bench, bench_table
from tests.unit.test_model import inputs64

STOCK = {
    "mode": "fwdbwd",
    "row": "stock",
    "batch": 16,
    "precision": "bf16",
    "samples_s_per_gpu": 26.0,
    "peak_gib": 72.7,
    "flops_per_sample": 2.04e13,
    "ceiling_tflops": 794.0,
}
OURS_FP8 = STOCK | {
    "row": "ours-fp8-tensorwise",
    "precision": "fp8 tensorwise",
    "samples_s_per_gpu": 32.5,
    "profile": {"gemm": 237.0, "fp8 casts": 48.0, "compute idle": 45.1},
    "top_kernels": [["nvjet_qqtst_128x256", "gemm", 90.5, 57], ["triton_red_fused_abs_amax_0", "fp8 casts", 3.25, 114]],
}
STEP = {
    "mode": "step",
    "row": "ours",
    "label": "ours ddp",
    "world": 2,
    "batch": 16,
    "precision": "fp8 tensorwise",
    "samples_s_per_gpu": 26.0,
    "peak_gib": 120.0,
    "flops_per_sample": 2.04e13,
    "ceiling_tflops": 794.0,
}


def test_table_gives_ratios_efficiency_and_top_kernels(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    delayed = STEP | {"precision": "fp8 delayed", "fp8_startup": {"steps": 4, "extra_s": 1.73}}
    rows.write_text("".join(json.dumps(r) + "\n" for r in (STOCK, OURS_FP8, STEP, delayed)))
    assert bench.main(["--table", str(rows)]) == 0
    out = capsys.readouterr().out
    fp8_line = next(line for line in out.splitlines() if line.startswith("fwdbwd ours-fp8-tensorwise"))
    assert "1.25x" in fp8_line  # 32.5 / 26.0, against the stock row of the same mode and batch
    step = next(line for line in out.splitlines() if line.startswith("step")).split()
    # no stock step row: no ratio claimed; step efficiency = 26.0 step / 32.5 fwdbwd of the same precision, batch
    assert step[-3:] == ["-", "0.80", "-"]
    assert "FP8 start-up: 4 steps until every operand had an amax history, 1.73 s beyond" in out
    assert next(line for line in out.splitlines() if line.startswith("fp8 casts")).split() == ["fp8", "casts", "48.0"]
    kernels = out.split("top kernels, ours-fp8-tensorwise fp8 tensorwise:")[1].splitlines()[1:3]
    assert [k.split() for k in kernels] == [
        ["90.50", "57", "gemm", "nvjet_qqtst_128x256"],
        ["3.25", "114", "fp8", "casts", "triton_red_fused_abs_amax_0"],
    ]


def test_profile_breakdown_sums_kinds_from_kernels_and_ranks_them():
    """The kernels a profile of two steps gave (name, start us, end us), summed by kind per step."""
    # two steps: per step a GEMM (2 ms), an amax (0.5 ms) launched twice, an all-gather overlapping the GEMM
    kernels = []
    for step in range(2):
        t = step * 10_000
        kernels += [
            ("nvjet_tst_128x256", t, t + 2_000),
            ("triton_red_fused_abs_amax_0", t + 2_000, t + 2_250),
            ("triton_red_fused_abs_amax_0", t + 2_250, t + 2_500),
            ("ncclDevKernel_AllGather", t + 500, t + 4_500),
        ]
    kinds, top, _ = bench_table.kernel_breakdown(kernels, wall_ms=10.0, steps=2, top=3)
    assert kinds["gemm"] == 2.0 and kinds["fp8 casts"] == 0.5 and kinds["nccl"] == 4.0
    assert kinds["compute busy"] == 2.5  # the NCCL kernel is not compute
    assert kinds["compute idle"] == 7.5 and kinds["step (profiled)"] == 10.0
    assert top == [
        ["ncclDevKernel_AllGather", "nccl", 4.0, 1],
        ["nvjet_tst_128x256", "gemm", 2.0, 1],
        ["triton_red_fused_abs_amax_0", "fp8 casts", 0.5, 2],  # ms and launches per step
    ]


def test_profile_breakdown_says_what_the_idle_compute_stream_waited_for():
    """Gaps between compute kernels, grouped by the kernel that ended them and the collective running most inside
    them; two overlapping collectives in one gap count once in the idle time a collective covers."""
    kernels = []
    for step in range(2):
        t = step * 10_000
        kernels += [
            ("nvjet_tst_128x256", t, t + 2_000),
            ("ncclDevKernel_AllGather", t + 1_900, t + 2_800),  # 800 of the 1000-us gap after the GEMM
            ("ncclDevKernel_ReduceScatter", t + 2_500, t + 2_700),  # inside the all-gather: counted once
            ("block_forward", t + 3_000, t + 4_000),
            ("optimizer_kernel", t + 4_400, t + 5_000),  # 400 us with nothing running; 5 ms to the next step
        ]
    kinds, _, gaps = bench_table.kernel_breakdown(kernels, wall_ms=10.0, steps=2)
    assert kinds["compute busy"] == 3.6 and kinds["compute idle"] == 6.4
    assert kinds["idle between kernels"] == 3.9 and kinds["idle, a collective running"] == 0.8
    assert gaps == [
        [2.5, 0.5, "nvjet_tst_128x256", ""],  # between the two steps
        [1.0, 1.0, "block_forward", "ncclDevKernel_AllGather"],
        [0.4, 1.0, "optimizer_kernel", ""],
    ]


def test_a_failed_row_says_what_happened_in_one_line():
    """A row's error names what stopped it -- out of memory with torch's sizes, an illegal memory access, a
    compile failure, anything else by its type -- in one line (the messages as torch raises them, several lines
    long; the rows themselves need a GPU)."""
    oom = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which 612.00 "
        "MiB is free. Including non-PyTorch memory, this process has 78.58 GiB memory in use.\nOf the allocated "
        "memory 75.10 GiB is allocated by PyTorch"
    )
    illegal = torch.AcceleratorError(
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported"
    )
    from torch._inductor.exc import InductorError

    compile_failed = InductorError(ValueError("bad\nconfig"), "line one\nline two")
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    lines = {
        "cublas": bench.row_error(cublas),
        "oom": bench.row_error(oom),
        "illegal": bench.row_error(illegal),
        "compile": bench.row_error(compile_failed),
        "other": bench.row_error(KeyError("fp8_scale")),
    }
    assert all("\n" not in line for line in lines.values())
    assert lines["oom"].startswith("out of memory") and "Tried to allocate 1.50 GiB" in lines["oom"]
    assert "612.00 MiB is free" in lines["oom"] and "allocated by PyTorch" not in lines["oom"]
    assert lines["illegal"].startswith("illegal memory access")
    assert lines["cublas"].startswith("out of memory") and bench.usable_after(cublas)  # cuBLAS's workspace
    assert lines["compile"].startswith("compile failed (InductorError)")
    assert lines["other"] == "KeyError: 'fp8_scale'"
    # an out of memory leaves the process able to measure the next row; a CUDA error does not
    assert bench.usable_after(oom) and not bench.usable_after(illegal) and bench.usable_after(KeyError("x"))


def test_a_step_row_is_labelled_by_its_micro_batch_failed_or_not():
    """A failed step row (out of memory, say) names the micro-batch it ran, as a measured one does, not the
    forward+backward rows' --batch (the full model's ddp step on two H200 at micro-batch 8 was shown as 16)."""
    from argparse import Namespace

    from flux_train.config import load_config

    cfg = load_config("configs/systems/H200_01x08.yaml", ["train.micro_batch_size=8"])
    assert bench.row_batch(cfg, Namespace(mode="step", batch=16)) == 8
    assert bench.row_batch(cfg, Namespace(mode="fwdbwd", batch=4)) == 4


def test_fwdbwd_rows_are_graphed_where_the_trainer_would_capture_its_step():
    """Under perf.cuda_graphs=auto (an H200 system config: ddp) our rows run graphed as the trainer's step would, and
    eager with the fsdp layout, which cannot capture; the no-graphs ablation never, a config's `true` always."""
    from flux_train.config import load_config

    auto = load_config("configs/systems/H200_01x08.yaml")
    assert bench.row_perf(auto, "ours-fp8-delayed").cuda_graphs is True
    assert bench.row_perf(auto, "ours").cuda_graphs is True
    assert bench.row_perf(auto, "ours-no-graphs").cuda_graphs is False
    fsdp = load_config("configs/systems/H200_01x08.yaml", ["parallel.strategy=fsdp"])
    assert bench.row_perf(fsdp, "ours-fp8-delayed").cuda_graphs is False
    forced = load_config("configs/bench.yaml")
    assert bench.row_perf(forced, "ours").cuda_graphs is True
    assert bench.row_perf(forced, "ours-no-graphs").cuda_graphs is False
    assert bench.row_perf(forced, "torchao-fp8-tensorwise").fp8_impl == "torchao"


def test_step_rows_settle_fp8_until_every_operand_has_an_amax_history(tmp_path):
    """Step rows time steady steps: first, FP8 delayed trains until every operand's history holds a maximum. The
    debug model's gates and final layer start at zero, as the full model's do, so its output gradients need more
    than the first step. The real Trainer, on the CPU."""
    from flux_train.training import distributed
    from flux_train.training.precision import DelayedFP8
    from flux_train.training.train import Trainer

    overrides = ["data.source=synthetic", "eval.enabled=false", "perf.fp8=delayed", "train.compute_dtype=bfloat16"]
    overrides += [f"logging.out_dir={tmp_path / 'run'}", "checkpoint.every_steps=0", "perf.warmup_iters=1"]
    trainer = Trainer(load_config("configs/debug.yaml", overrides))
    try:
        trainer.warm_up(1)
        assert isinstance(trainer.precision, DelayedFP8)
        scaling = trainer.precision.scaling
        assert scaling.without_history() > 0  # the warm-up resets the histories
        assert bench.settle_fp8(trainer, limit=1)[0] == 1
        assert scaling.without_history() > 0  # one step leaves the zero gradients' histories empty
        steps, seconds = bench.settle_fp8(trainer)
        assert steps >= 1 and seconds > 0
        assert scaling.without_history() == 0
        assert trainer.state.step == 1 + steps
        assert bench.settle_fp8(trainer) == (0, pytest.approx(0, abs=0.5))  # settled: nothing more runs
    finally:
        trainer.close()
        distributed.shutdown()


def test_stock_rows_checkpoint_every_block_with_diffusers_own_when_ours_do():
    """With parallel.activation_checkpointing the stock model recomputes each block's forward in backward (diffusers'
    enable_gradient_checkpointing), so a checkpointed row of ours has a stock row on the same terms; its gradients
    are those of the model without."""
    plain = bench.stock_flux(load_config("configs/debug.yaml"), "cpu").double()
    cfg = load_config("configs/debug.yaml", ["parallel.activation_checkpointing=true"])
    checkpointed = bench.stock_flux(cfg, "cpu").double()
    checkpointed.load_state_dict(plain.state_dict())
    kw = diffusers_inputs(inputs64(cfg.model))
    calls = []
    blocks = [*checkpointed.transformer_blocks, *checkpointed.single_transformer_blocks]
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    grads = []
    for model in (plain, checkpointed):
        model(**kw)[0].square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert len(calls) == 2 * len(blocks)  # each block's forward, and again in backward
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_the_casts_rows_gelu_inputs_are_those_a_forward_of_our_model_casts_with_their_gelu(monkeypatch, capsys):
    """`bench --mode casts` times the casts that apply a GELU at the shapes gelu_cast_inputs lists: the inputs that
    a forward of our model hands gelu_linear (rows, head and tail columns, the tail's row stride, the Linear's
    outputs, how many), and the table shows both timings of each."""
    from collections import Counter

    from flux_train.model import flux

    cfg = load_config("configs/debug.yaml")
    model = flux.build_model(cfg.model)
    model.to_empty(device="cpu")
    flux.init_weights(model, seed=0)
    seen = Counter()
    unwrapped = flux.gelu_linear

    def recording(linear, head, tail):
        rows, columns = tail.numel() // tail.shape[-1], tail.shape[-1]
        seen[(rows, 0 if head is None else head.shape[-1], columns, tail.stride(-2), linear.out_features)] += 1
        return unwrapped(linear, head, tail)

    monkeypatch.setattr(flux, "gelu_linear", recording)
    kw = inputs64(cfg.model, batch=2, text=8, side=8)
    with torch.no_grad():
        model(**{k: v.float() for k, v in kw.items()})
    listed = bench.gelu_cast_inputs(cfg, batch=2, text_len=8, image_tokens=16)
    assert Counter(listed) == seen

    row = {"mode": "casts", "row": "ours-fp8-delayed", "batch": 2, "ms": 1.0, "floor_ms": 0.8, "copy_tb_s": 3.0}
    bench_table.print_table([row | {"shapes": [], "gelu": [[32, 0, 256, 2, 10.5, 20.25]]}])
    assert "      32 x     0+  256 x   2:     10.5 us in the cast     20.2 us apart" in capsys.readouterr().out
