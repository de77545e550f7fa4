"""Resume is exact, saves are atomic, export loads in diffusers."""

import signal
import subprocess
import sys
import time

import pytest
import torch
from run_outputs import column, losses, train, train_command

from flux_train.config import load_config
from flux_train.kernels import RMSNorm
from flux_train.model.diffusers_adapter import diffusers_inputs
from flux_train.outputs.results import read_events
from flux_train.tools.export import main as export_main
from flux_train.training import checkpoint
from flux_train.training.preemption import EXIT_CODE as EXIT_PREEMPTED
from flux_train.training.train_state import TrainState

pytestmark = pytest.mark.slow  # every test trains

COMMON = [
    "--set",
    "data.source=synthetic",
    "--set",
    "eval.enabled=false",
    "--set",
    "logging.log_every=1",
    "--set",
    "train.warmup_steps=3",
    "--set",
    "train.caption_dropout_prob=0.1",
]


def crashed_after_step_4(out):
    """Make a run that ended at its step cap look like one that crashed there: no run_stop in its log (a finished
    run is not started again)."""
    log = out / "mllog.log"
    log.write_text("".join(line for line in log.read_text().splitlines(True) if '"run_stop"' not in line))


def run(out, *extra):
    proc = train(out, *COMMON, *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_preempted_run_checkpoints_and_resumes_with_the_same_losses(tmp_path):
    """SIGUSR2 (Slurm's warning signal) -> checkpoint + exit 75; the resumed run matches an uninterrupted one."""
    split = tmp_path / "split"
    proc = subprocess.Popen(
        train_command(split, *COMMON, "--set", "train.max_steps=100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and len(losses(split)) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, out[-2000:]
    stopped = max(losses(split))
    assert f"step_{stopped:08d}" in out and 3 <= stopped < 1000

    end = stopped + 5
    run(tmp_path / "full", "--set", f"train.max_steps={end}")
    assert "resumed from" in run(split, "--set", f"train.max_steps={end}")
    full, resumed = losses(tmp_path / "full"), losses(split)
    assert sorted(resumed) == list(range(1, end + 1))
    for step in range(1, end + 1):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
    # one run in the MLLOG file: the resumed part continued it instead of starting another
    keys = [e["key"] for e in read_events(split / "mllog.log")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1


def test_interrupted_save_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(out, "--set", "train.max_steps=4", "--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep=5")
    root = out / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000002", "step_00000004"]

    # a save that dies half-way through writing the shards
    def dying_save(state, checkpoint_id):
        (torch.save({"partial": 1}, f"{checkpoint_id}/__0_0.distcp"))
        raise KeyboardInterrupt("killed mid-save")

    import torch.distributed as dist

    from flux_train.data.sources import build_data
    from flux_train.model.flux import build_model, reference_init
    from flux_train.training.distributed import build_mesh
    from flux_train.training.layout import build_training

    cfg = load_config("configs/debug.yaml", [f"logging.out_dir={out}", "data.source=synthetic"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(cfg.model)
        training = build_training(
            model, build_mesh(cfg.parallel, 1, 1, "cpu"), cfg.parallel, cfg.train, torch.float32, torch.device("cpu")
        )
        training.assign_weights(reference_init(model, 0, "cpu"))
        monkeypatch.setattr(checkpoint.dcp, "save", dying_save)
        loader = build_data(cfg, 0, 1).train
        parts = {"progress": TrainState.of_run(cfg, 1), "layout": training, "loader": loader}
        with pytest.raises(KeyboardInterrupt):
            checkpoint.Checkpointer(root, keep=5).save(6, parts)
        monkeypatch.undo()
        assert (root / "step_00000006.tmp").is_dir()
        latest = checkpoint.resolve_resume(cfg, 1)
        assert latest.name == "step_00000004"
        checkpoint.load(latest, parts)
        assert parts["progress"].step == 4 and loader.state_dict() == {"consumed": 4}
    finally:
        dist.destroy_process_group()
    # and a real resume continues from step 4
    crashed_after_step_4(out)
    assert "resumed from" in run(out, "--set", "train.max_steps=5")


def test_a_finished_run_is_not_started_again(tmp_path):
    out = tmp_path / "run"
    run(out, "--set", "train.max_steps=2", "--set", "checkpoint.every_steps=2")
    proc = train(out, *COMMON, "--set", "train.max_steps=4")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"config error: {out} holds a finished run (run_stop in mllog.log); choose a new logging.out_dir, or set "
        "checkpoint.resume=none to start over in this one"
    ]
    keys = [e["key"] for e in read_events(out / "mllog.log")]
    assert keys.count("run_stop") == 1 and keys.count("init_start") == 1


def test_retention_keeps_last_k(tmp_path):
    out = tmp_path / "run"
    run(out, "--set", "train.max_steps=6", "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep=2")
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_00000005", "step_00000006"]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_export_loads_with_diffusers_from_pretrained_and_reproduces_our_output(tmp_path, strategy):
    from diffusers import FluxTransformer2DModel

    from flux_train.model.flux import build_model

    out = tmp_path / "run"
    run(
        out, "--set", "train.max_steps=3", "--set", "checkpoint.every_steps=3", "--set", f"parallel.strategy={strategy}"
    )
    export = tmp_path / "export"
    assert (
        export_main(
            ["export", "--config", "configs/debug.yaml", "--checkpoint", str(out / "checkpoints"), "--out", str(export)]
        )
        == 0
    )
    loaded = FluxTransformer2DModel.from_pretrained(str(export)).double()
    assert loaded.config.num_layers == 2 and loaded.config.joint_attention_dim == 4096
    # our model with the checkpoint's weights (a DCP load of the same step) and the exported diffusers model
    # predict the same velocities
    ours = build_model(load_config("configs/debug.yaml").model, rmsnorm_impl="torch")
    ours.to_empty(device="cpu")
    state = {"model": ours.state_dict()}
    checkpoint.dcp.load(state, checkpoint_id=str(out / "checkpoints" / "step_00000003"), no_dist=True)
    ours.load_state_dict(state["model"])
    ours.double()
    for norm in ours.modules():  # diffusers' Q/K norms take eps 1e-6 (ours the op-math type's machine epsilon, as the
        if isinstance(norm, RMSNorm):  # reference's): the comparison is of the exported weights
            norm.eps = 1e-6
    assert not torch.all(state["model"]["final_layer.linear.weight"] == 0)  # trained away from its zero init
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(2, 16, 64, generator=g, dtype=torch.float64), torch.randn(2, 8, 4096, generator=g).double()
    y, t = torch.randn(2, 768, generator=g).double(), torch.rand(2, generator=g).double()
    ids = torch.stack([torch.zeros(16), torch.arange(16) // 4, torch.arange(16) % 4], 1)
    with torch.no_grad():
        kw = dict(img=img, img_ids=ids, txt=txt, txt_ids=torch.zeros(8, 3), timesteps=t, y=y)
        want = ours(**kw)
        got = loaded(**diffusers_inputs(kw))[0]
    assert want.abs().max() > 0
    assert ((got - want).norm() / want.norm()).item() <= 1e-10
    assert (export / "diffusion_pytorch_model.safetensors").stat().st_mode & 0o044 == 0o044  # others can read it


def test_an_export_that_does_not_compute_the_checkpoint_s_model_is_removed_in_one_line(tmp_path, monkeypatch, capsys):
    """The export is loaded back and checked before the command succeeds: a mapping that forgets to swap the final
    adaLN's halves (planted here) still loads in diffusers, and is caught by its output."""
    from flux_train.model import diffusers_adapter

    out = tmp_path / "run"
    run(out, "--set", "train.max_steps=2")
    monkeypatch.setattr(diffusers_adapter, "_swap_halves", lambda t: t)
    export = tmp_path / "export"
    argv = ["export", "--config", "configs/debug.yaml", "--checkpoint", str(out / "checkpoints"), "--out", str(export)]
    assert export_main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: the export {export} loaded with FluxTransformer2DModel.from_pretrained computes another output than "
        "the checkpoint's model (relative difference "
    ), err
    assert err[0].endswith("it was removed: report this with the checkpoint's config")
    assert not export.exists()


class ModelOnly:
    """Stands for a training layout as the Checkpointer saves one, holding the model alone (an optimizer's moments
    would add 4 GB to this test)."""

    def __init__(self, weights: dict):
        self.weights = weights

    def state_dict(self) -> dict:
        return {"model": self.weights}


# the debug config at FLUX.1's width, which the single-file layout's readers take as given, one block of each kind
FLUX1_WIDTH = [
    "model.num_layers=1",
    "model.num_single_layers=1",
    "model.num_attention_heads=24",
    "model.attention_head_dim=128",
    "model.axes_dims_rope=[16,56,56]",
]
# black-forest-labs' names in flux1-schnell.safetensors (19 double and 38 single blocks there), with their shapes
BFL_BLOCK_0 = {
    "img_in.weight": [3072, 64],
    "time_in.in_layer.weight": [3072, 256],
    "vector_in.in_layer.weight": [3072, 768],
    "txt_in.weight": [3072, 4096],
    "double_blocks.0.img_mod.lin.weight": [18432, 3072],
    "double_blocks.0.img_attn.qkv.weight": [9216, 3072],
    "double_blocks.0.img_attn.norm.query_norm.scale": [128],
    "double_blocks.0.txt_mlp.2.weight": [3072, 12288],
    "single_blocks.0.linear1.weight": [21504, 3072],
    "single_blocks.0.linear2.weight": [3072, 15360],
    "single_blocks.0.modulation.lin.weight": [9216, 3072],
    "single_blocks.0.norm.key_norm.scale": [128],
    "final_layer.adaLN_modulation.1.weight": [6144, 3072],
    "final_layer.linear.weight": [64, 3072],
}


def test_a_bfl_export_is_black_forest_labs_single_file_and_loads_with_from_single_file(tmp_path, capsys):
    """`--format bfl` writes the checkpoint's tensors under black-forest-labs' names in one .safetensors file, which
    the command loads back with diffusers' from_single_file (offline) and checks against our model before it says
    so; a 0.5 B model saved as the trainer saves one."""
    import torch.distributed as dist
    from safetensors import safe_open

    from flux_train.model.flux import build_model, materialize
    from flux_train.tools.export import read_weights

    cfg = load_config("configs/debug.yaml", FLUX1_WIDTH)
    model = materialize(build_model(cfg.model, rmsnorm_impl="torch"), torch.device("cpu"), seed=0)
    with torch.no_grad():
        for p in model.parameters():  # as trained: no zero-initialised layer left
            p.add_(0.02 * torch.randn_like(p))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parts = {"progress": TrainState.of_run(cfg, 1), "layout": ModelOnly(model.state_dict())}
        saved = checkpoint.Checkpointer(tmp_path / "checkpoints", keep=1).save(1, parts)
    finally:
        dist.destroy_process_group()
    del model
    out = tmp_path / "exported" / "flux1-schnell-trained.safetensors"
    sets = [arg for setting in FLUX1_WIDTH for arg in ("--set", setting)]
    argv = ["export", "--format", "bfl", "--config", "configs/debug.yaml", *sets, "--checkpoint", str(saved)]
    assert export_main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith(
        f"exported {saved} -> {out} (loaded back with FluxTransformer2DModel.from_single_file; its forward pass "
        "differs from the checkpoint's model by "
    ), printed
    expected = read_weights(cfg, saved)
    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        assert {k: list(f.get_slice(k).get_shape()) for k in BFL_BLOCK_0} == BFL_BLOCK_0
        assert all(torch.equal(f.get_tensor(k), v) for k, v in expected.items())
    assert out.stat().st_mode & 0o044 == 0o044  # others can read it
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no partial file beside it
    assert export_main([*argv, "--out", str(out)]) == 2  # nothing is overwritten
    assert capsys.readouterr().err.strip() == (
        f"error: --out {out} exists; give a new file to write the export into (nothing is overwritten)"
    )


def test_init_from_an_exported_model_starts_where_it_ended(tmp_path):
    """model.init_from round trip: a run started from an export evaluates to the exported model's val loss."""
    out = tmp_path / "run"
    run(
        out,
        "--set",
        "train.max_steps=4",
        "--set",
        "checkpoint.every_steps=4",
        "--set",
        "eval.enabled=true",
        "--set",
        "eval.every_steps=4",
        "--set",
        "eval.target=0",
    )
    export = tmp_path / "export"
    argv = ["--config", "configs/debug.yaml", "--checkpoint", str(out / "checkpoints"), "--out", str(export)]
    done = subprocess.run(
        [sys.executable, "-m", "flux_train.checkpoint", "export", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # as a user runs it: one line saying what was written, and no notes from libraries (torchao's "Failed to
    # load" of kernels for other GPUs) that read as a failure
    assert done.returncode == 0 and done.stderr == "" and len(done.stdout.splitlines()) == 1, done.stderr[-2000:]
    again = tmp_path / "again"
    run(
        again,
        "--set",
        "train.max_steps=1",
        "--set",
        "train.lr=1e-30",
        "--set",
        "train.warmup_steps=0",
        "--set",
        f"model.init_from={export}",
        "--set",
        "eval.enabled=true",
        "--set",
        "eval.every_steps=1",
        "--set",
        "eval.target=0",
    )

    # eval draws its noise from (seed, eval index): the first eval of each run sees the same noise
    assert column(again, "val_loss")[0] == pytest.approx(column(out, "val_loss")[0], rel=1e-4)


def test_warm_up_before_run_start_leaves_training_unchanged(tmp_path):
    """perf.warmup_iters runs real steps (compile happens there) but restores weights and optimizer state."""
    run(tmp_path / "cold", "--set", "train.max_steps=4")
    run(tmp_path / "warm", "--set", "train.max_steps=4", "--set", "perf.warmup_iters=2")
    cold, warm = losses(tmp_path / "cold"), losses(tmp_path / "warm")
    assert sorted(warm) == [1, 2, 3, 4]
    assert all(warm[s] == pytest.approx(cold[s], rel=1e-6, abs=1e-7) for s in cold)


def async_checkpoints_complete_and_resume_exactly(tmp_path, device: str) -> None:
    """checkpoint.async_save: every save is completed (renamed) by the next save or the end of the run, and a
    resume from one continues with the losses of an uninterrupted run. On a GPU the state is staged through
    pinned host buffers reused from one save to the next (the second save is the one resumed from)."""
    out = tmp_path / "async"
    on = ["--set", f"train.device={device}"]
    run(
        out,
        *on,
        "--set",
        "train.max_steps=4",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "checkpoint.keep=5",
        "--set",
        "checkpoint.async_save=true",
    )
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_00000002", "step_00000004"]
    assert not list((out / "checkpoints").glob("*.tmp"))
    run(tmp_path / "full", *on, "--set", "train.max_steps=6")
    crashed_after_step_4(out)
    assert "resumed from" in run(out, *on, "--set", "train.max_steps=6", "--set", "checkpoint.async_save=true")
    full, resumed = losses(tmp_path / "full"), losses(out)
    assert sorted(resumed) == list(range(1, 7))
    rel = 1e-6 if device == "cpu" else 1e-4  # GPU kernels may sum in a different order from run to run
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(full[step], rel=rel, abs=1e-7), step


def test_async_checkpoints_complete_and_resume_exactly(tmp_path):
    """On the CPU (on a GPU: tests/gpu/test_checkpoint.py)."""
    async_checkpoints_complete_and_resume_exactly(tmp_path, "cpu")


def test_fp8_run_resumed_after_its_warm_up_continues_exactly(tmp_path):
    """A delayed-scaling FP8 run resumed from its step-4 checkpoint continues with the losses of the run that
    never stopped: the checkpoint carries the amax history, and the warm-up steps (synthetic tensors, then the
    optimizer's moments and the amax history reset) run before the checkpoint is loaded, not after."""
    fp8 = ["--set", "train.compute_dtype=bfloat16", "--set", "perf.fp8=delayed", "--set", "perf.warmup_iters=1"]
    run(tmp_path / "full", *fp8, "--set", "train.max_steps=6")
    out = tmp_path / "split"
    run(out, *fp8, "--set", "train.max_steps=4", "--set", "checkpoint.every_steps=4")
    crashed_after_step_4(out)
    assert "resumed from" in run(out, *fp8, "--set", "train.max_steps=6")
    full, resumed = losses(tmp_path / "full"), losses(out)
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
    assert column(out, "fp8_overflows")[-1] == column(tmp_path / "full", "fp8_overflows")[-1]
