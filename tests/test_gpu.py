"""GPU checks (marker gpu; skipped without a GPU, run on the device machine): compiled and graphed steps against
eager (model and trainer), the attention backend, FP8 on tensor cores against its CPU emulation. The Triton
kernels' own tests (tests/test_kernels.py) run on a GPU or in Triton's CPU interpreter."""

import pytest
import torch

from flux_train import flow
from flux_train.config import ModelConfig
from flux_train.model import build_model, materialize
from flux_train.perf import CudaGraph, compile_blocks, select_attention_backend
from run_outputs import column, set_flags, train

pytestmark = pytest.mark.gpu


def small_model(rmsnorm="auto", compile_mode="none"):
    cfg = ModelConfig(
        flavor="gpu-test",
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=128,
        num_attention_heads=4,
        axes_dims_rope=[16, 56, 56],
    )
    model = materialize(build_model(cfg, rmsnorm), torch.device("cuda"), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return compile_blocks(model.to(torch.bfloat16), compile_mode), cfg


def inputs(cfg, batch=4):
    g = torch.Generator(device="cuda").manual_seed(1)
    kw = dict(
        img=torch.randn(batch, 64, 64, device="cuda", generator=g).bfloat16(),
        img_ids=flow.image_ids(16, 16, "cuda"),
        txt=torch.randn(batch, 32, 4096, device="cuda", generator=g).bfloat16(),
        txt_ids=flow.text_ids(32, "cuda"),
        timesteps=torch.rand(batch, device="cuda", generator=g).bfloat16(),
        y=torch.randn(batch, 768, device="cuda", generator=g).bfloat16(),
    )
    return kw, torch.randn(batch, 64, 64, device="cuda", generator=g)


def loss_and_grads(model, kw, target):
    for p in model.parameters():
        p.grad = None
    loss = flow.mse_loss(model(**kw), target)
    loss.backward()
    return loss.item(), {n.replace("._orig_mod", ""): p.grad.float().clone() for n, p in model.named_parameters()}


def assert_grads_close(a, b):
    for name in a:
        scale = a[name].abs().max().item() + 1e-12
        assert (a[name] - b[name]).abs().max().item() <= 0.05 * scale, name


def test_compiled_and_graphed_steps_match_eager():
    select_attention_backend("flash")
    torch.manual_seed(0)
    eager, cfg = small_model(rmsnorm="torch")
    kw, target = inputs(cfg)
    loss_e, grads_e = loss_and_grads(eager, kw, target)

    compiled, _ = small_model(rmsnorm="triton")
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled, "block")
    loss_c, grads_c = loss_and_grads(compiled, kw, target)
    assert loss_c == pytest.approx(loss_e, rel=2e-2)
    assert_grads_close(grads_e, grads_c)

    params = list(compiled.parameters())

    def step():
        for p in params:
            p.grad = None
        loss = flow.mse_loss(compiled(**kw), target)
        loss.backward()
        return loss.detach()

    graphed = CudaGraph(step)
    loss_g = graphed().item()
    assert loss_g == pytest.approx(loss_c, rel=1e-3)
    assert_grads_close(grads_c, {n.replace("._orig_mod", ""): p.grad.float() for n, p in compiled.named_parameters()})


def test_attention_backend_is_selected_and_trains():
    select_attention_backend("flash")
    assert torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.mem_efficient_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled()
    model, cfg = small_model()
    kw, target = inputs(cfg)
    loss, grads = loss_and_grads(model, kw, target)  # flash only: fails loudly if flash cannot run this
    assert loss > 0 and all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linear_on_tensor_cores_matches_its_cpu_emulation(recipe):
    """torch._scaled_mm with our operand layouts and scales computes what the CPU emulation computes (same
    e4m3 values and scales; only the accumulation order differs), forward and both gradients."""
    from flux_train.kernels.fp8 import linear

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 64, 256, generator=g) * torch.logspace(-2, 2, 256)).bfloat16()
    w = torch.randn(384, 256, generator=g) * 0.05
    dy = torch.randn(2, 64, 384, generator=g).bfloat16()
    results = {}
    for device in ("cpu", "cuda"):
        xd, wd = x.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
        y = linear(xd, wd, None, recipe)
        y.backward(dy.to(device))
        results[device] = [t.float().cpu() for t in (y, xd.grad, wd.grad)]
    for cpu, gpu in zip(results["cpu"], results["cuda"]):
        assert ((gpu - cpu).norm() / cpu.norm()).item() < 1e-2


@pytest.mark.parametrize("nproc", [1, 2])
def test_trainer_graphed_steps_equal_eager_steps(tmp_path, nproc):
    """perf.cuda_graphs (ddp layout, compiled blocks, accumulation 3, the whole step in one graph: on 2 GPUs with
    the reduce-scatters, the norm's all-reduce and the all-gathers inside) trains like the eager step: losses
    and grad norms over 6 steps, the learning rate changing every step (warm-up)."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    runs = {}
    for graphs in (False, True):
        out = tmp_path / f"graphs{graphs}"
        sets = {
            "data.source": "synthetic",
            "train.device": "cuda",
            "train.compute_dtype": "bfloat16",
            "perf.attention": "flash",
            "perf.compile": "block",
            "parallel.strategy": "ddp",
            "perf.cuda_graphs": str(graphs).lower(),
            "perf.warmup_iters": 1,
            "perf.warmup_latent_size": 8,
            "train.max_steps": 6,
            "train.warmup_steps": 4,
            "train.micro_batch_size": 2,
            "train.global_batch_size": 6 * nproc,
            "eval.enabled": "false",
            "logging.log_every": 1,
            "logging.progress_bar": "false",
        }
        proc = train(out, *set_flags(sets), nproc=nproc, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[graphs] = (column(out, "loss"), column(out, "grad_norm"))
    assert len(runs[True][0]) == 6
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-2)
    assert runs[True][1] == pytest.approx(runs[False][1], rel=2e-2)
