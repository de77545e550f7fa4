"""The synthetic source's train stream: its order (rank slices of one global order, whatever the number of ranks),
its resume, and its micro-batches made ahead by a thread of their own."""

import threading

import torch

from flux_train.config import load_config
from flux_train.data.sources import build_synthetic, made_ahead


def stream(rank: int, world: int):
    cfg = load_config(
        "configs/debug.yaml",
        [
            "data.source=synthetic",
            "data.synthetic_train_samples=12",
            "data.synthetic_val_samples=4",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
        ],
    )
    return build_synthetic(cfg, rank, world).train


def taken(s, n: int) -> list[torch.Tensor]:
    return [next(s)["t5"] for _ in range(n)]


def test_two_ranks_take_the_halves_of_the_global_batches_one_rank_takes_across_epochs():
    one = taken(stream(0, 1), 12)  # three steps of four micro-batches: 24 samples, two epochs of 12
    halves = [taken(stream(r, 2), 6) for r in (0, 1)]
    for step in range(3):
        whole = torch.cat(one[4 * step : 4 * step + 4])
        split = torch.cat(halves[0][2 * step : 2 * step + 2] + halves[1][2 * step : 2 * step + 2])
        assert torch.equal(whole, split)
    first_epoch, second_epoch = torch.cat(one[:6]), torch.cat(one[6:])
    assert len({t.sum().item() for t in first_epoch}) == 12  # every sample once an epoch
    assert not torch.equal(first_epoch, second_epoch)  # reshuffled
    assert sorted(t.sum().item() for t in first_epoch) == sorted(t.sum().item() for t in second_epoch)


def test_a_stream_moved_back_by_its_state_gives_the_batches_from_there_not_those_made_ahead():
    reference = taken(stream(0, 1), 8)
    s = stream(0, 1)
    taken(s, 5)  # with micro-batches made ahead of position 5
    s.load_state_dict({"consumed": 2})
    assert s.state_dict() == {"consumed": 2}
    assert all(torch.equal(a, b) for a, b in zip(taken(s, 6), reference[2:]))


def test_batches_are_made_by_another_thread_up_to_depth_ahead_and_the_end_ends_the_stream():
    made, release = [], threading.Event()

    def batches():
        for i in range(6):
            if i == 4:
                release.wait(10)
            made.append((i, threading.current_thread() is threading.main_thread()))
            yield {"i": i}

    ahead = made_ahead(batches(), depth=3)
    assert next(ahead) == {"i": 0}
    for _ in range(100):  # batches 1-3 are made while 0 is used
        if len(made) == 4:
            break
        threading.Event().wait(0.01)
    assert [i for i, _ in made] == [0, 1, 2, 3] and not any(on_main for _, on_main in made)
    release.set()
    assert [b["i"] for b in ahead] == [1, 2, 3, 4, 5]
