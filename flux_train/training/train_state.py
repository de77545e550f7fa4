"""Where a run is (step, evals) and what it was started with: the one schema of a checkpoint's progress.pt, used
by the trainer, the checkpointer and the bench; the checkpoint's `progress` part."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# what a resume must share with the run that wrote the checkpoint, and the setting a user changes for each: the
# layout the optimizer state and the loader order depend on, and the batch size the samples count is made of
SHARED = {
    "world_size": "world size (nodes x GPUs per node)",
    "strategy": "parallel.strategy",
    "global_batch_size": "train.global_batch_size",
    "data_source": "data.source",
    "num_workers": "data.num_workers",
}


@dataclass
class TrainState:
    world_size: int
    strategy: str
    global_batch_size: int
    data_source: str
    num_workers: int
    step: int = 0
    eval_count: int = 0

    @classmethod
    def of_run(cls, cfg, world_size: int) -> TrainState:
        """A run's state at its start."""
        return cls(
            world_size,
            cfg.parallel.strategy,
            cfg.train.global_batch_size,
            cfg.data.source,
            cfg.data.num_workers,
        )

    @property
    def samples(self) -> int:
        """Training samples seen: MLLOG's samples_count."""
        return self.step * self.global_batch_size

    def state_dict(self) -> dict:
        """What progress.pt holds (plain types: it is read back with weights_only)."""
        return dataclasses.asdict(self) | {"samples": self.samples}

    def load_state_dict(self, state_dict: dict) -> None:
        """Where a checkpoint's run was (the settings it must share were checked before: checkpoint.check_resumable)."""
        saved = self.from_progress(state_dict)
        self.step, self.eval_count = saved.step, saved.eval_count

    @classmethod
    def from_progress(cls, progress) -> TrainState:
        """A progress.pt's contents; ValueError when it is not one (garbled, yet unpickled). Settings a checkpoint
        of an earlier version lacks are None: they are not compared."""
        step, world = (progress.get("step"), progress.get("world_size")) if isinstance(progress, dict) else (None, None)
        if not isinstance(step, int) or not isinstance(world, int) or not 1 <= world < 2**20:
            raise ValueError("holds no step and world size")
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in progress.items() if k in names}
        return cls(**{**dict.fromkeys(SHARED), **known})

    def differences(self, saved: TrainState) -> list[str]:
        """How a checkpoint's settings differ from this run's, one phrase each (the synthetic source's order does
        not depend on the loader workers)."""
        keys = [k for k in SHARED if not (k == "num_workers" and self.data_source != "energon")]
        return [
            f"{SHARED[k]} {getattr(saved, k)}, this run has {getattr(self, k)}"
            for k in keys
            if getattr(saved, k) is not None and getattr(saved, k) != getattr(self, k)
        ]
