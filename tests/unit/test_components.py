"""The trainer's components apart from a Trainer, on the CPU in a process group of one rank, in seconds: the
Evaluator (a flux-debug model, a few synthetic val samples), the pictures after an eval, the Checkpointer (a state
of two tensors) and TrainState (progress.pt's schema)."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from flux_train.config import load_config
from flux_train.data.sources import build_synthetic
from flux_train.errors import StorageError
from flux_train.model.flux import build_model, materialize
from flux_train.outputs.mllog import MLLogger, read_records
from flux_train.outputs.report import REPORT_FILE
from flux_train.training import checkpoint
from flux_train.training.evaluate import Evaluator
from flux_train.training.heartbeat import Heartbeat
from flux_train.training.pictures import Pictures
from flux_train.training.train_state import SHARED, TrainState

VAL_SAMPLES = 5  # in batches of 2: the last batch is padded, and the padding must not count


@pytest.fixture
def one_rank():
    """A gloo process group of one rank: the eval's sum and the checkpoint's saves are collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def debug_config(*overrides: str):
    return load_config(
        "configs/debug.yaml",
        ["data.source=synthetic", f"data.synthetic_val_samples={VAL_SAMPLES}", "eval.batch_size=2", *overrides],
    )


@pytest.fixture
def eval_parts(one_rank, tmp_path):
    """What a Trainer hands its Evaluator, built here: the model, the val set, an MLLOG file, a heartbeat."""
    cfg = debug_config()
    model = materialize(build_model(cfg.model, rmsnorm_impl="torch"), torch.device("cpu"), seed=0)
    heartbeat = Heartbeat(tmp_path / "heartbeats", 0)
    parts = dict(
        model=model,
        val=build_synthetic(cfg, 0, 1).val,
        val_size=VAL_SAMPLES,
        mllog=MLLogger(tmp_path / "mllog.log", enabled=True),
        heartbeat=heartbeat,
        rank=0,
        device=torch.device("cpu"),
        dtype=torch.float32,
        seed=cfg.train.seed,
        latent_shift=cfg.train.latent_shift,
        latent_scale=cfg.train.latent_scale,
        every=25,
        target=0.0,
        after_eval=lambda step: None,
        after_pass=lambda: None,
    )
    yield cfg, parts
    heartbeat.stop()


def test_an_eval_is_due_every_interval_and_never_when_off(eval_parts):
    _, parts = eval_parts
    every25 = Evaluator(**parts)
    assert [s for s in range(1, 101) if every25.due(s)] == [25, 50, 75, 100]
    assert not any(Evaluator(**parts | {"every": 0}).due(s) for s in range(1, 101))


def test_a_pass_is_seeded_by_the_eval_index_and_counts_every_val_sample_once(eval_parts):
    _, parts = eval_parts
    passes = []
    evaluator = Evaluator(**parts | {"after_pass": lambda: passes.append(1)})
    parts["model"].train()
    first = evaluator.loss(0)
    assert first.count == VAL_SAMPLES  # the padded slot of the last batch is not counted
    assert evaluator.loss(0) == first  # the same noise again
    assert evaluator.loss(1).loss != first.loss  # the next eval draws fresh noise
    assert parts["model"].training  # the pass leaves the model as it found it
    parts["model"].eval()
    evaluator.loss(0)
    assert not parts["model"].training
    assert len(passes) == 4  # the layout's after_eval after every pass (FSDP reshards)


def test_the_loss_of_each_timestep_averages_to_the_val_loss_weighted_by_its_samples(eval_parts):
    """Val sample i is noised at t = (i mod 8) / 8: of 11 samples, t = 0, 1/8, 2/8 have two each, the others one.
    Each t's loss is its own sum over its own count (the last batch's padding sits in t = 0's bin, counted in none)."""
    _, parts = eval_parts
    val = Evaluator(**parts | {"val": build_synthetic(debug_config("data.synthetic_val_samples=11"), 0, 1).val}).loss(0)
    counts = {k / 8: 2 if k < 3 else 1 for k in range(8)}
    assert val.count == 11 and list(val.by_timestep) == list(counts)
    assert sum(counts[t] * loss for t, loss in val.by_timestep.items()) / 11 == pytest.approx(val.loss, rel=1e-12)
    assert len(set(val.by_timestep.values())) == 8  # each t its own loss


def test_an_eval_logs_its_events_and_row_then_calls_after_eval_unless_it_reached_the_target(eval_parts, tmp_path):
    cfg, parts = eval_parts
    called, rows = [], []

    def after(step):  # what was logged when it was called (the pictures read the rows written before them)
        called.append((step, len(rows), [r["key"] for r in read_records(tmp_path / "mllog.log")]))

    state = replace(TrainState.of_run(cfg, 1), step=25)
    missed = Evaluator(**parts | {"target": 0.0, "after_eval": after})
    done = missed.run(state, rows.append)
    assert done.reached is False and done.seconds > 0
    assert called == [(25, 1, ["eval_start", "eval_accuracy", "eval_stop"])] and state.eval_count == 1
    samples = 25 * cfg.train.global_batch_size
    (row,) = rows
    assert row["step"] == 25 and row["samples"] == samples and row["val_loss"] > 0
    assert list(row["val_loss_by_t"]) == [0.0, 0.125, 0.25, 0.375, 0.5]  # 5 val samples: t = 0/8 .. 4/8
    assert parts["heartbeat"].state == (25, "eval")  # a hung eval is named as one
    records = read_records(tmp_path / "mllog.log")
    assert [r["key"] for r in records] == ["eval_start", "eval_accuracy", "eval_stop"]
    assert all(r["metadata"]["samples_count"] == samples for r in records)
    assert records[1]["value"] == pytest.approx(row["val_loss"])

    # one that reached it ends the run: the trainer calls after_eval after run_stop, not the Evaluator
    state.step = 50
    reached = Evaluator(**parts | {"target": float("inf"), "after_eval": after})
    assert reached.run(state, rows.append).reached is True
    assert len(called) == 1 and rows[-1]["step"] == 50 and state.eval_count == 2


def test_an_eval_that_does_not_count_the_whole_val_set_is_refused_before_its_result(eval_parts, tmp_path):
    cfg, parts = eval_parts
    called = []
    evaluator = Evaluator(**parts | {"val_size": VAL_SAMPLES + 1, "after_eval": called.append})
    with pytest.raises(RuntimeError, match=f"eval counted {VAL_SAMPLES} samples, the val set has {VAL_SAMPLES + 1}"):
        evaluator.run(replace(TrainState.of_run(cfg, 1), step=25), lambda row: None)
    assert [r["key"] for r in read_records(tmp_path / "mllog.log")] == ["eval_start"]  # no result was logged
    assert called == []


class GreySampler:
    """Stands for flux_train.tools.sample.Sampler: a grid whose grey level is the first weight it was given."""

    def __init__(self):
        self.given = []

    def grid(self, state):
        self.given.append(state)
        return Image.new("L", (4, 4), int(next(iter(state.values())).flatten()[0]))


def test_after_an_eval_the_report_and_a_grid_of_the_gathered_weights_are_drawn(one_rank, tmp_path):
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, 7.0)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 1, "samples": 8, "val_loss": 0.9}\n')
    sampler = GreySampler()
    pictures = Pictures(
        out_dir=tmp_path, global_batch_size=8, target=0.5, model=model, is_main=True, samples=True, sampler=sampler
    )
    pictures.after_eval(3)
    assert (tmp_path / REPORT_FILE).is_file()
    assert Image.open(tmp_path / "samples" / "step_00000003.png").getpixel((0, 0)) == 7
    assert set(sampler.given[0]) == {"weight", "bias"}


def test_a_picture_that_cannot_be_written_is_a_warning(one_rank, tmp_path, capsys):
    (tmp_path / "samples").write_text("a file where the grids' folder goes")
    pictures = Pictures(
        out_dir=tmp_path,
        global_batch_size=8,
        target=0.5,
        model=torch.nn.Linear(2, 2),
        is_main=True,
        samples=True,
        sampler=GreySampler(),
    )
    pictures.after_eval(3)  # no metrics.jsonl yet, and no folder for the grid: neither stops the run
    err = capsys.readouterr().err
    assert f"flux-train: warning: could not write {tmp_path / 'samples' / 'step_00000003.png'}" in err


def test_a_trainer_given_no_sampler_refuses_sample_prompts_before_it_writes_anything(tmp_path):
    """Samples are drawn by flux_train.tools.sample, which training does not import: whoever starts a run hands
    the Trainer its sampler (the train command and the cluster worker do)."""
    from flux_train.config import ConfigError
    from flux_train.training.train import Trainer

    cfg = debug_config(f"logging.out_dir={tmp_path / 'run'}", "eval.sample_prompts=p.txt", "eval.sample_weights=w")
    with pytest.raises(ConfigError, match="eval.sample_prompts: this trainer was given no sampler"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


class TwoTensors:
    """Stands for a training layout: what the Checkpointer and checkpoint.load use of one. Like ddp.DDP's, its state
    holds its own tensors and a step count made for the call, which only load_state_dict puts back."""

    def __init__(self, value: float):
        self.weights, self.moments, self.steps = torch.full((3, 4), value), torch.full((5,), value), 0

    def state_dict(self) -> dict:
        return {"model": {"w": self.weights}, "optim": {"m": self.moments, "steps": torch.tensor(self.steps)}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.weights.copy_(state_dict["model"]["w"])
        self.moments.copy_(state_dict["optim"]["m"])
        self.steps = int(state_dict["optim"]["steps"])


def run_state(step: int) -> TrainState:
    return replace(TrainState.of_run(debug_config(), 1), step=step, eval_count=step // 2)


def run_parts(step: int, layout: TwoTensors) -> dict:
    """A checkpoint's parts at `step`: its progress, the layout, the synthetic loader `step` micro-batches on."""
    loader = build_synthetic(debug_config(), 0, 1).train
    loader.load_state_dict({"consumed": step})
    return {"progress": run_state(step), "layout": layout, "loader": loader}


def test_a_checkpoint_is_due_every_interval_and_never_when_off(one_rank, tmp_path):
    every3 = checkpoint.Checkpointer(tmp_path, keep=1, every_steps=3)
    assert [s for s in range(1, 10) if every3.due(s)] == [3, 6, 9]
    assert not any(checkpoint.Checkpointer(tmp_path, keep=1).due(s) for s in range(1, 10))


def test_saves_are_complete_the_last_k_are_kept_and_load_restores_them(one_rank, tmp_path):
    saver, layout = checkpoint.Checkpointer(tmp_path, keep=2), TwoTensors(0.0)
    for step in (1, 2, 3):
        layout.weights.fill_(step)
        layout.steps = step
        path = saver.save(step, run_parts(step, layout))
        assert path == tmp_path / f"step_{step:08d}" and checkpoint.unreadable(path) is None
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert not list(tmp_path.glob("*.tmp"))

    restored = run_parts(0, TwoTensors(-1.0))
    checkpoint.load(tmp_path / "step_00000002", restored)
    assert restored["progress"] == run_state(2) and restored["loader"].state_dict() == {"consumed": 2}
    restored = restored["layout"]
    assert (restored.weights == 2).all() and (restored.moments == 0).all() and restored.steps == 2


def test_an_async_save_holds_the_state_of_its_step_and_completes_at_the_next_wait(one_rank, tmp_path):
    saver, layout = checkpoint.Checkpointer(tmp_path, keep=2, async_save=True), TwoTensors(1.0)
    path = saver.save(4, run_parts(4, layout))
    layout.weights.fill_(9.0)  # training goes on while the files are written
    assert checkpoint.list_checkpoints(tmp_path) == []  # not complete before it is waited for
    assert saver.wait() == path and checkpoint.list_checkpoints(tmp_path) == [path]
    saver.close()
    restored = TwoTensors(0.0)
    checkpoint.load(path, run_parts(0, restored))
    assert (restored.weights == 1).all()


def test_a_runs_last_save_is_written_at_once_even_where_saves_are_async(one_rank, tmp_path):
    """A preemption's save and the final one: nothing trains after them, so they are not staged (on a GPU that
    would first allocate the pinned buffers: minutes for a 12B state) but complete when save returns."""
    saver, layout = checkpoint.Checkpointer(tmp_path, keep=2, async_save=True), TwoTensors(1.0)
    path = saver.save(4, run_parts(4, layout), last=True)
    assert saver.pending is None and checkpoint.list_checkpoints(tmp_path) == [path]
    saver.close()
    restored = TwoTensors(0.0)
    checkpoint.load(path, run_parts(0, restored))
    assert (restored.weights == 1).all()


def test_a_save_that_cannot_be_written_is_a_storage_error_naming_the_checkpoint(one_rank, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("where the checkpoint folder goes")
    with pytest.raises(StorageError, match=f"writing checkpoint {blocked / 'step_00000001'} failed"):
        checkpoint.Checkpointer(blocked, keep=1).save(1, run_parts(1, TwoTensors(0.0)))


def test_train_state_is_progress_pt_and_round_trips_through_it(tmp_path):
    state = replace(TrainState.of_run(debug_config(), 4), step=7, eval_count=2)
    progress = state.state_dict()
    assert set(progress) == {*SHARED, "step", "eval_count", "samples"}
    assert progress["samples"] == 7 * 8 and progress["world_size"] == 4 and progress["data_source"] == "synthetic"
    torch.save(progress, tmp_path / "progress.pt")
    assert TrainState.from_progress(torch.load(tmp_path / "progress.pt", weights_only=True)) == state
    # a checkpoint written before the parts had names holds FP8 scales there (checkpoint.load takes them)
    assert TrainState.from_progress(progress | {"fp8": {"history": [[1.0]]}}) == state
    resumed = TrainState.of_run(debug_config(), 4)
    resumed.load_state_dict(progress)
    assert resumed == state


@pytest.mark.parametrize(
    "progress", [None, [], {}, {"step": 3}, {"step": "3", "world_size": 1}, {"step": 3, "world_size": 0}]
)
def test_a_progress_without_step_and_world_size_is_refused(progress):
    with pytest.raises(ValueError, match="holds no step and world size"):
        TrainState.from_progress(progress)


def test_a_resume_must_share_the_layout_batch_and_data_and_an_older_checkpoint_is_not_held_to_what_it_lacks():
    run = TrainState.of_run(debug_config("data.num_workers=1"), 2)
    assert run.differences(run) == []
    other = replace(run, world_size=4, strategy="ddp", global_batch_size=16, data_source="energon", num_workers=3)
    assert run.differences(other) == [
        "world size (nodes x GPUs per node) 4, this run has 2",
        "parallel.strategy ddp, this run has fsdp",
        "train.global_batch_size 16, this run has 8",
        "data.source energon, this run has synthetic",
    ]  # the synthetic source's order does not depend on the loader workers
    energon = replace(run, data_source="energon")
    assert energon.differences(replace(energon, num_workers=3)) == ["data.num_workers 3, this run has 1"]
    older = TrainState.from_progress({"step": 5, "world_size": 2})  # a checkpoint of an earlier version
    assert older.strategy is None and run.differences(older) == []
