"""The energon loaders in fresh processes, loader workers and gloo ranks: a train stream's state restored in
another process continues exactly, the val pass covers every sample once on any number of ranks, two ranks train
on an uneven fixture, a garbled sample read by a worker ends the run in one line (the rest:
tests/unit/test_data_energon.py)."""

import json
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from run_outputs import column, set_flags, train

from dataprep import digests
from dataprep.fixture import FixtureSpec, fixture_samples, write_fixture
from dataprep.format import (
    decode_bf16,
)
from flux_train.data.energon import EnergonVal
from tests.unit.test_data_energon import SPEC, fingerprint, stream

RESUME = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from flux_train.config import DataConfig
    from flux_train.data.energon import EnergonTrainStream
    path, state, workers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    d = DataConfig(num_workers=workers, shuffle_buffer_size=10, max_samples_per_sequence=5)
    s = EnergonTrainStream(path, 1, 2, 3, d, 7)
    s.load_state_dict(torch.load(state, weights_only=True))
    print(json.dumps([[round(float(v), 4) for v in next(s)["clip"][:, 0].float()] for _ in range(6)]))
""")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The unit tests' fixture dataset (SPEC), written once for this module."""
    return write_fixture(tmp_path_factory.mktemp("energon") / "ds", SPEC)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_state_restored_in_a_fresh_process_continues_exactly(dataset, tmp_path, workers):
    ref = stream(dataset, rank=1, world=2, workers=workers)
    for _ in range(5):
        next(ref)
    torch.save(ref.state_dict(), tmp_path / "state.pt")
    expected = [fingerprint(next(ref)) for _ in range(6)]
    proc = subprocess.run(
        [sys.executable, "-c", RESUME, str(dataset), str(tmp_path / "state.pt"), str(workers)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected


def val_sample_ids():
    """clip[0] of val sample i (val i copies train i here, all distinct) -> i."""
    return {round(float(decode_bf16(r["parts"]["clip"])[0]), 4): i for i, r in enumerate(fixture_samples(SPEC, "val"))}


@pytest.mark.slow
@pytest.mark.parametrize("world,workers", [(1, 0), (2, 0), (3, 0), (3, 2)])
def test_val_covers_every_sample_once_with_equal_batches_per_rank(dataset, world, workers):
    ids, counted, batches = val_sample_ids(), [], []
    for rank in range(world):
        val = EnergonVal(dataset, rank, world, batch=4, num_workers=workers)
        assert val.size == SPEC.val
        next(iter(val()))  # an abandoned pass (the trainer probes shapes this way) must not disturb the next
        for _ in range(2):  # two evals see the same samples
            passes = list(val())
            batches.append(len(passes))
            mine = []
            for b in passes:
                assert b["t5"].shape[0] == 4 and b["valid"].dtype == torch.bool and b["timestep"].dtype == torch.int64
                real = [ids[v] for v in fingerprint({"clip": b["clip"][b["valid"]]})]
                assert [int(t) for t in b["timestep"][b["valid"]]] == [i % 8 for i in real]
                mine += real
            counted.append(mine)
    assert len(set(batches)) == 1, batches  # every rank runs the same number of forwards
    once = [i for mine in counted[::2] for i in mine]
    assert sorted(once) == list(range(SPEC.val))  # every val sample exactly once per pass
    assert counted[::2] == counted[1::2]


@pytest.mark.slow
def test_val_rank_without_samples_runs_the_same_padded_batches(tmp_path):
    small = write_fixture(tmp_path / "small", FixtureSpec(train=4, val=2, text_len=2, height=2, width=2))
    passes = [list(EnergonVal(small, rank, 3, batch=4, num_workers=0)()) for rank in range(3)]
    assert [len(p) for p in passes] == [1, 1, 1]
    assert [int(p[0]["valid"].sum()) for p in passes] == [1, 1, 0]


@pytest.mark.slow
def test_two_rank_training_reads_an_uneven_fixture_through_energon(tmp_path):
    """torchrun, 2 ranks, 13 val samples in batches of 4: ranks hold 7 and 6 samples, both run 2 forwards;
    the trainer checks that the eval counted all 13."""
    proc = train(
        tmp_path,
        "--set",
        "data.source=energon",
        "--set",
        "data.num_workers=1",
        "--set",
        "data.synthetic_val_samples=13",
        "--set",
        f"data.fixture_dir={tmp_path / 'fixture'}",
        "--set",
        "train.max_steps=4",
        "--set",
        "eval.every_steps=2",
        "--set",
        "eval.batch_size=4",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "logging.log_every=2",
        nproc=2,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(column(tmp_path, "val_loss")) == 2
    assert list((tmp_path / "fixture").glob("*/.nv-meta/dataset.yaml"))  # the fixture it wrote and read


@pytest.mark.slow
def test_a_garbled_sample_read_by_a_loader_worker_ends_the_run_in_one_line(dataset, tmp_path):
    """The worker's error reaches the trainer with the worker's whole traceback as its message: one line of it. The
    shards' digests are removed: as in data made by another tool, only the read finds the garbled sample."""
    copy = shutil.copytree(dataset, tmp_path / "ds")
    (copy / "train" / digests.FILE).unlink()
    shard = copy / "train" / "shard_000001.tar"
    with tarfile.open(shard) as tar:
        member = next(m for m in tar if m.name.endswith(".t5.bytes"))
    with open(shard, "r+b") as f:
        f.seek(member.offset_data)
        f.write(b"garbage!" * 4)
    proc = train(
        tmp_path / "run",
        *set_flags({"data.path": copy, "data.num_workers": 1, "train.max_steps": 6, "eval.enabled": "false"}),
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"data error: train/shard_000001.tar: sample {member.name.split('.')[0]}: t5.bytes: ")
