"""Samples from trained weights through diffusers' FluxPipeline (the schnell sampler), with tiny random VAE/T5/CLIP
(tests/support/tiny_models.py): the command writes a PNG grid of the asked size from a checkpoint, bad inputs end in one
line, and the trainer draws a grid per eval after the eval's MLLOG events when eval.sample_prompts is set."""

import json

import numpy as np
import pytest
import run_outputs
import torch
from PIL import Image
from tiny_models import encoder_flags

from flux_train.config import load_config
from flux_train.model.diffusers_adapter import to_diffusers
from flux_train.outputs.results import read_events
from flux_train.tools import sample
from flux_train.tools.export import read_weights
from flux_train.training import train

pytestmark = pytest.mark.slow  # every test trains or reads a trained run

PROMPTS = ["a photo of a cat", "a red dog on the green", "blue"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A flux-debug run of 2 steps on the synthetic set, checkpointed at its end (in-process: no energon workers)."""
    out = tmp_path_factory.mktemp("run")
    assert (
        train.main(
            [
                "--config",
                "configs/debug.yaml",
                "--set",
                "data.source=synthetic",
                "--set",
                "eval.enabled=false",
                "--set",
                f"logging.out_dir={out}",
                "--set",
                "train.max_steps=2",
                "--set",
                "checkpoint.every_steps=2",
            ]
        )
        == 0
    )
    return out


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:2]) + "\n\n" + PROMPTS[2] + "\n")  # blank lines are no prompts
    return path


def sample_flags(models, vae=None):
    """The tiny encoders' flags with a VAE: the tiny one unless `vae` names another."""
    return encoder_flags(models, vae or models / "vae")


def cells(grid: Image.Image, size: int, columns: int) -> list[np.ndarray]:
    array = np.asarray(grid).astype(int)
    return [
        array[r * size : (r + 1) * size, c * size : (c + 1) * size]
        for r in range(grid.height // size)
        for c in range(columns)
    ]


def test_sample_command_writes_a_grid_of_the_asked_size(trained, tiny_models, prompts, tmp_path, capsys):
    out, exported = tmp_path / "grid.png", tmp_path / "exported"
    rc = sample.main(
        [
            "--checkpoint",
            str(trained / "checkpoints"),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--size",
            "32",
            "--columns",
            "2",
            "--exported",
            str(exported),
            *sample_flags(tiny_models),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr()
    assert f"wrote {out}: 3 images of 32x32 from {trained / 'checkpoints' / 'step_00000002'}" in printed.out
    assert printed.err == ""  # the libraries' notes and progress bars stay quiet
    grid = Image.open(out)
    assert grid.format == "PNG" and grid.size == (64, 64)  # 3 images of 32 px in 2 columns
    first, second, third, empty = cells(grid, 32, 2)
    assert (empty == 255).all()  # the cell after the last prompt stays white
    assert np.abs(first - second).mean() > 1 and np.abs(first - third).mean() > 1  # each prompt its own image

    # the export is the checkpoint's model as diffusers loads it
    from diffusers import FluxTransformer2DModel

    cfg = load_config(trained / "config.yaml")
    expected = to_diffusers(read_weights(cfg, trained / "checkpoints" / "step_00000002"), cfg.model)
    loaded = FluxTransformer2DModel.from_pretrained(exported).state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_bad_inputs_end_in_one_line(trained, tiny_models, prompts, tmp_path, capsys):
    vae = tmp_path / "sd-vae"
    vae.mkdir()
    config = json.loads((tiny_models / "vae" / "config.json").read_text())
    (vae / "config.json").write_text(json.dumps(config | {"scaling_factor": 0.18215, "shift_factor": None}))
    weights = "diffusion_pytorch_model.safetensors"
    (vae / weights).symlink_to(tiny_models / "vae" / weights)
    base = ["--prompts", str(prompts), "--out", str(tmp_path / "grid.png")]
    cases = [
        (
            ["--checkpoint", str(trained / "checkpoints"), *sample_flags(tiny_models, vae)],
            f"error: the VAE in {vae} has scaling_factor 0.18215, shift_factor None; the model was trained with "
            "train.latent_scale 0.3611, latent_shift 0.1159: give FLUX.1-schnell's vae/",
        ),
        (
            ["--checkpoint", str(tmp_path), *sample_flags(tiny_models)],
            f"error: --checkpoint {tmp_path}: no complete checkpoint there (a step_XXXXXXXX folder with progress.pt, "
            "or the folder holding them)",
        ),
        (
            ["--checkpoint", str(trained / "checkpoints"), "--size", "40", *sample_flags(tiny_models)],
            "error: --size 40: must be a positive multiple of 16 (VAE 8x, then 2x2 patches)",
        ),
    ]
    for args, message in cases:
        assert sample.main([*base, *args]) == 2
        assert capsys.readouterr().err == message + "\n"
    assert not (tmp_path / "grid.png").exists()


def test_outputs_that_cannot_be_written_end_in_one_line(trained, tiny_models, prompts, tmp_path, capsys):
    """--out a folder, --exported a folder that holds files: refused before any work, exit 2 (a traceback from the
    image library, and an export written into the user's folder); --out or --exported where no file can be made:
    one line, exit 74 (a traceback). The user's files stay as they were."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own\n")
    base = ["--checkpoint", str(trained / "checkpoints"), "--prompts", str(prompts), "--size", "32"]
    grid = str(tmp_path / "grid.png")
    cases = [
        (["--out", str(mine)], 2, f"error: --out {mine} is a folder; give the path of the file to write"),
        (
            ["--out", grid, "--exported", str(mine)],
            2,
            f"error: --exported {mine} exists; give a new folder to write the export into (nothing is overwritten)",
        ),
        (
            ["--out", "/proc/nope/grid.png"],
            74,
            "fatal: --out /proc/nope/grid.png: writing it failed (No such file or directory); give a path that can be "
            "written",
        ),
        (
            ["--out", grid, "--exported", "/proc/nope"],
            74,
            "fatal: writing the export --exported /proc/nope failed (No such file or directory: /proc/.nope.",
        ),
    ]
    for args, code, line in cases:
        assert sample.main([*base, *args, *sample_flags(tiny_models)]) == code
        err = capsys.readouterr().err
        assert err.startswith(line) and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "prompts.txt"]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


@pytest.fixture
def flux(tiny_models, tmp_path):
    """The tiny models in the pipeline folder layout eval.sample_weights names."""
    folder = tmp_path / "FLUX.1-schnell"
    folder.mkdir()
    for name, source in (
        ("vae", "vae"),
        ("text_encoder_2", "t5"),
        ("tokenizer_2", "tokenizer"),
        ("text_encoder", "clip"),
        ("tokenizer", "tokenizer"),
    ):
        (folder / name).symlink_to(tiny_models / source)
    return folder


def test_trainer_draws_the_grid_the_command_draws_after_each_eval_s_mllog_events(tiny_models, flux, prompts, tmp_path):
    """Two ranks (FSDP shards gathered to rank 0): a grid per eval, drawn between eval_stop and the next block_start,
    the same pixels as the command draws from the checkpoint of that step."""
    out = tmp_path / "run"
    proc = run_outputs.train(
        out,
        "--set",
        "data.source=synthetic",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "eval.every_steps=2",
        "--set",
        "logging.log_every=2",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        f"eval.sample_prompts={prompts}",
        "--set",
        f"eval.sample_weights={flux}",
        nproc=2,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    grids = sorted((out / "samples").iterdir())
    assert [g.name for g in grids] == ["step_00000002.png", "step_00000004.png"]
    assert f"samples of step 2: {grids[0]}" in proc.stdout
    assert all(Image.open(g).size == (512, 512) for g in grids)  # 3 images of 256 px, 2 columns
    events = read_events(out / "mllog.log")
    eval_stop = next(e["time_ms"] for e in events if e["key"] == "eval_stop")
    block_start = [e["time_ms"] for e in events if e["key"] == "block_start"][1]
    assert eval_stop <= grids[0].stat().st_mtime_ns / 1e6 <= block_start + 1  # between the eval and the next block

    drawn = tmp_path / "drawn.png"
    assert (
        sample.main(
            [
                "--checkpoint",
                str(out / "checkpoints" / "step_00000004"),
                "--prompts",
                str(prompts),
                "--out",
                str(drawn),
                *sample_flags(tiny_models),
            ]
        )
        == 0
    )
    pixels = [np.asarray(Image.open(path)).astype(int) for path in (drawn, *grids)]
    same_step, earlier_step = np.abs(pixels[0] - pixels[2]), np.abs(pixels[0] - pixels[1])
    assert same_step.max() <= 1 and same_step.mean() < 0.01  # float rounding of other thread counts at most
    assert earlier_step.mean() > 0.1  # two training steps earlier: other weights, other pixels


def test_an_out_of_memory_error_in_a_grid_is_one_warning_and_the_run_trains_on_to_the_same_losses(
    flux, prompts, tmp_path, capfd, monkeypatch
):
    """A CUDA out-of-memory error raised inside the first grid's transformer (planted: this machine has no GPU to run
    out of) costs that grid and one warning line: the run trains to its step cap with the losses of a run without
    samples, and the next eval's grid is drawn."""
    from diffusers import FluxTransformer2DModel

    forward, calls = FluxTransformer2DModel.forward, []

    def out_of_memory_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB (planted by the test)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(FluxTransformer2DModel, "forward", out_of_memory_once)
    common = ["data.source=synthetic", "train.max_steps=4", "eval.every_steps=2", "logging.log_every=1"]
    runs = {"samples": tmp_path / "samples", "none": tmp_path / "none"}
    drawn = [f"eval.sample_prompts={prompts}", f"eval.sample_weights={flux}"]
    for name, out in runs.items():
        extra = drawn if name == "samples" else []
        argv = ["--config", "configs/debug.yaml", *run_outputs.set_flags([*common, *extra, f"logging.out_dir={out}"])]
        assert train.main(argv, sampler=sample.Sampler.for_run) == 0
    err = capfd.readouterr().err
    grids = runs["samples"] / "samples"
    assert [line for line in err.splitlines() if "warning" in line or "Traceback" in line] == [
        f"flux-train: warning: could not write {grids / 'step_00000002.png'} (OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 24.00 GiB (planted by the test)); training goes on"
    ]
    assert [g.name for g in grids.iterdir()] == ["step_00000004.png"]  # the next grid is drawn
    rows = {name: run_outputs.metrics(out) for name, out in runs.items()}
    assert [r.get("loss", r.get("val_loss")) for r in rows["samples"]] == [
        r.get("loss", r.get("val_loss")) for r in rows["none"]
    ]
    assert len([r for r in rows["none"] if "val_loss" in r]) == 2
