"""Checkpoints: save/resume of a run's named stateful parts (torch's `Stateful`: state_dict/load_state_dict), atomic,
last K kept; the model's weights read back in one process (flux_train.tools.export writes them as a diffusers folder).

The parts (Trainer.parts): `progress` (flux_train.training.train_state: step, eval count, and the settings a resume
must share: world size, strategy, global batch size, data source and loader workers), `layout` (the model and
optimizer, sharded over the ranks), and any other, which each rank holds its own of: `loader` (its position in the
data), `precision` (flux_train.training.precision: FP8 delayed scaling's amax histories). On disk,
<dir>/step_00001234/ holds the DCP shards of the layout's {"model", "optim"}, `<part>_rank<r>.pt` per other part
and rank, and `progress.pt`, which names those parts and is written last. A checkpoint written before the parts
had names holds the loader's files and, with FP8 delayed scaling, the precision's state in progress.pt (key `fp8`):
both are loaded as they are. A save goes to `step_XXXX.tmp/` (made there and marked with STAGING_MARK: only such
leftovers are removed) and is renamed once every rank has finished,
so a crash mid-save leaves the previous checkpoint the latest valid one; a save that fails (a full disk) fails
on every rank alike. No RNG state is needed: every random stream is seeded from (seed, step, micro-batch)
(flow.seeded_generator).

Resuming (`checkpoint.resume=auto`) takes the newest checkpoint that reads back whole and skips, naming them,
the ones that do not (a shard cut short, missing metadata or loader state, an empty progress file), as a crash,
a full disk or a copy cut short leaves them; one of another model or layout is refused before anything starts.

With `checkpoint.async_save` a save copies the state to host memory and returns (on a GPU into pinned buffers
that are kept for the next save: several times faster than pageable copies); the files are written by a
background thread (over a gloo group of its own, so training's collectives are not shared with it) while
training goes on, and the checkpoint is completed (renamed) when the next save starts or the run ends.
"""

from __future__ import annotations

import re
import shutil
import sys
import typing
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from flux_train.config import ConfigError, ModelConfig, checkpoint_dir
from flux_train.errors import StateMisfit, StorageError, UserError, raise_on_every_rank
from flux_train.training.train_state import TrainState

STEP_DIR = re.compile(r"^step_(\d{8})$")
PROGRESS = "progress.pt"
# written first into every step_XXXXXXXX.tmp/ a save makes: what marks a leftover as one of ours, to be removed
STAGING_MARK = ".flux-train-staging"
# the parts a checkpoint holds by name: `progress` in progress.pt, `layout` in DCP shards, any other per rank
OWN = ("progress", "layout")
EARLIER_PARTS = ["loader"]  # the per-rank parts of a checkpoint whose progress.pt names none


def rank_file(part: str, rank: int) -> str:
    return f"{part}_rank{rank}.pt"


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed from or exported; the message names it, why, and the fix."""

    label = "checkpoint error"


def step_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of `step` goes (STEP_DIR's form)."""
    return root / f"step_{step:08d}"


def staging_of(final: Path) -> Path:
    """Where the save of checkpoint `final` is written until it is complete."""
    return final.with_name(final.name + ".tmp")


def made_here(tmp: Path) -> bool:
    """Whether `tmp`, a save's staging folder, is one a save made (its mark inside, or empty: made, then cut before
    the mark): only those are removed; a folder of that name the user keeps there is not."""
    return tmp.is_dir() and not tmp.is_symlink() and ((tmp / STAGING_MARK).is_file() or not any(tmp.iterdir()))


def remove_staging(tmp: Path) -> None:
    """A save's staging folder, if a save made it (made_here)."""
    if made_here(tmp):
        shutil.rmtree(tmp, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary `.tmp` folders of interrupted saves are ignored)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / PROGRESS).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))  # STEP_DIR matched: digits follow


def last_good(root: Path) -> str:
    """The sentence naming the checkpoint a failed run can be resumed from."""
    found = list_checkpoints(root)
    return (
        f"the last good checkpoint is {found[-1]} (checkpoint.resume=auto picks it up)"
        if found
        else "no checkpoint was written before it"
    )


# free bytes left beside a failed save that mean it ran out of room (a write to a full disk fills it to the last block)
FULL_BELOW = 1 << 20


def _os_error(exc: BaseException) -> OSError | None:
    """The OS error under `exc`: itself, or the one torch's writer met (in its context: torch.save raises a
    RuntimeError "[enforce fail at inline_container.cc] unexpected pos" over a failed write to a file object)."""
    found: BaseException | None = exc
    while found is not None and not isinstance(found, OSError):
        found = found.__cause__ or found.__context__
    return found


def brief(exc: BaseException) -> str:
    """An exception in a few words: the file it names, or its type and first line."""
    exc = _os_error(exc) or exc
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def failure_text(exc: CheckpointException) -> str:
    """The first failure DCP gathered from its ranks, in a few words."""
    return brief(next(iter(exc.failures.values()))[0])


def read_progress(path: Path) -> TrainState:
    """A checkpoint's progress.pt; ValueError saying why when it is missing, empty or garbled."""
    return TrainState.from_progress(_progress(path))


def _progress(path: Path) -> dict:
    """progress.pt's contents, checked to be a progress (read_progress's ValueError)."""
    try:
        progress = torch.load(path / PROGRESS, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load fails on a cut or garbled file in many ways
        raise ValueError(f"{PROGRESS} is unreadable ({brief(exc)})") from None
    try:
        TrainState.from_progress(progress)
    except ValueError as exc:
        raise ValueError(f"{PROGRESS} {exc}") from None
    return progress


def unreadable(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (None: every file it needs is there, whole): what a
    crash, a full disk or a copy cut short leaves. Shard contents are not read, only their sizes."""
    try:
        progress = _progress(path)
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a missing or garbled .metadata
        return f"its DCP metadata (.metadata) is missing or unreadable ({brief(exc)})"
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None or have < size:
            return f"{name} is {'missing' if have is None else f'cut short ({have} of {size} bytes)'}"
    for part in progress.get("parts", EARLIER_PARTS):
        for rank in range(progress["world_size"]):
            try:
                torch.load(path / rank_file(part, rank), weights_only=True)
            except Exception as exc:  # noqa: BLE001
                return f"the {part} state of rank {rank} is missing or unreadable ({brief(exc)})"
    return None


def model_mismatch(mcfg: ModelConfig, path: Path) -> str | None:
    """How the model saved at `path` differs from the one `mcfg` builds (None: same names and shapes)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from flux_train.model.flux import build_model

    saved = {
        name.removeprefix("model."): tuple(meta.size)
        for name, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
        if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    mine = {name: tuple(t.shape) for name, t in build_model(mcfg, rmsnorm_impl="torch").state_dict().items()}
    for name in sorted(mine.keys() | saved.keys()):
        if saved.get(name) != mine.get(name):
            there, here = (f"{list(s)}" if s else "missing" for s in (saved.get(name), mine.get(name)))
            return f"'{name}' is {there} there and {here} here (model.flavor {mcfg.flavor})"
    return None


def check_resumable(path: Path, cfg, world_size: int) -> None:
    """Refuse, naming the difference and the fix, a checkpoint this run cannot continue exactly."""
    saved = read_progress(path)
    fix = "resume with the run's own settings, or start this one in a new logging.out_dir"
    differences = TrainState.of_run(cfg, world_size).differences(saved)
    if differences:
        raise CheckpointError(f"checkpoint {path} was saved with {differences[0]}: {fix}")
    if saved.step > cfg.train.max_steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {saved.step}, past train.max_steps {cfg.train.max_steps}: raise "
            "train.max_steps to go on, or start over in a new logging.out_dir"
        )
    mismatch = model_mismatch(cfg.model, path)
    if mismatch:
        raise CheckpointError(f"checkpoint {path} holds another model: {mismatch}; {fix}")


def resolve_resume(cfg, world_size: int) -> Path | None:
    """`checkpoint.resume` (main rank only): auto = the newest checkpoint that reads back whole, each newer one it
    skips named on stderr; none = fresh; else that folder. The one chosen is checked against this run."""
    choice = cfg.checkpoint.resume
    if choice == "none":
        return None
    if choice != "auto":
        path = Path(choice)
        why = unreadable(path)
        if why:
            raise CheckpointError(
                f"checkpoint.resume={choice}: cannot resume from it: {why}; give a complete step_XXXXXXXX folder, "
                "auto (the newest readable one in checkpoint.dir) or none"
            )
        check_resumable(path, cfg, world_size)
        return path
    found = list_checkpoints(checkpoint_dir(cfg))
    for path in reversed(found):
        why = unreadable(path)
        if why is None:
            check_resumable(path, cfg, world_size)
            return path
        print(f"flux-train: warning: skipped checkpoint {path}: {why}", file=sys.stderr, flush=True)
    if found:
        raise CheckpointError(
            f"none of the {len(found)} checkpoints in {checkpoint_dir(cfg)} can be resumed from (above); restore one, "
            "or set checkpoint.resume=none to start over (the logs of the earlier run are replaced)"
        )
    return None


def remove_leftovers(root: Path, keep: Path | None = None) -> None:
    """The staging folders of saves that were interrupted (a crash, a full disk), as large as a checkpoint, but
    `keep` (a cut final save, the sign that it is to be completed); a folder of that form no save made is refused."""
    for tmp in sorted(root.glob("step_*.tmp")) if root.is_dir() else ():
        if not STEP_DIR.match(tmp.name.removesuffix(".tmp")):  # no name a save uses
            continue
        if not made_here(tmp):
            raise ConfigError(
                f"{tmp} was not made by a save of flux-train (no {STAGING_MARK} in it), and a save of that step "
                "would need its name: move it out of checkpoint.dir"
            )
        if tmp != keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _write(obj, path: Path) -> None:
    """torch.save through a file of ours: a failed write keeps its OS error (a path gets torch's own stream, which
    loses it)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def _on_every_rank(what: Path, write: Callable[[], object], group=None) -> None:
    """This rank's part of a save; when it fails on any rank every rank raises (none is left waiting in the next
    collective), the main rank with the first failure named."""
    try:
        write()
        error = None
    except CheckpointException as exc:  # DCP gathers the writers' failures and raises it on every rank
        error = failure_text(exc)
    except (OSError, RuntimeError) as exc:
        if _os_error(exc) is None:  # not a failed write: a bug, with its traceback
            raise
        error = brief(exc)
    # torch's words for a full disk ("unexpected pos"; DCP passes a rank's failure on without the OS error) say
    # nothing to a user: the free space says it
    if error is not None and _free_bytes(what.parent) < FULL_BELOW:
        error = f"the disk is full: no space left in {what.parent}; make room there"
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = next((e for e in errors if e), None)
    if failed:
        if dist.get_rank() == 0:
            remove_staging(staging_of(what))  # give the space back
        raise_on_every_rank(StorageError(f"writing checkpoint {what} failed ({failed})"), dist.get_rank() == 0)


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (a checkpoint's size on disk)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:  # a lost mount: not a full disk
        return FULL_BELOW


class Checkpointer:
    """Collective saves of a run's parts (the module docstring; the layout: layout.Layout, fsdp.FSDPTraining or
    ddp.DDP) under `root`, last `keep` kept."""

    def __init__(self, root: Path, keep: int, async_save: bool = False, every_steps: int = 0):
        self.root, self.keep, self.async_save, self.every_steps = root, keep, async_save, every_steps
        # the background writer's collectives run on a gloo group of their own
        self.group = typing.cast(dist.ProcessGroup, dist.new_group(backend="gloo")) if async_save else None
        self.pending: tuple | None = None  # (future, tmp folder, final folder, progress) of an async save
        self.stager = None
        if async_save and torch.cuda.is_available():
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            # pinned host buffers, allocated at the first save and reused; the copy ends before save returns
            # (DefaultStager with pinned memory failed at its second save with torch 2.11: KeyError <class 'type'>)
            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, step: int, parts: dict[str, Stateful], last: bool = False) -> Path:
        """Write a checkpoint of `parts` as they are at `step`; returns its final folder (complete on return unless
        async). `last`: the run ends after it (a preemption's save, the final one), so it is written at once, never
        staged: nothing trains during the write, and a first staging allocates the pinned host buffers (the 12B
        state's paused the loop 150 s on 4 H200, more than Slurm's default warning before a preemption)."""
        self.wait()
        rank = dist.get_rank()
        # as of now: training goes on during an async save
        own = {name: part.state_dict() for name, part in parts.items() if name not in OWN}
        progress = parts["progress"].state_dict() | {"parts": sorted(own)}
        final = step_folder(self.root, step)
        tmp = staging_of(final)

        def start() -> None:
            if rank == 0:
                remove_staging(tmp)  # a cut save of this step (a finished run's final save being completed)
                tmp.mkdir(parents=True)  # made here, not one that is there
                (tmp / STAGING_MARK).write_text(f"a save of {final.name} in progress, or cut\n")

        def write_own() -> None:
            for name, state in own.items():
                _write(state, tmp / rank_file(name, rank))

        _on_every_rank(final, start)  # a collective: the folder exists for every rank after it
        _on_every_rank(final, write_own)
        layout = parts["layout"]
        if self.async_save and not last:
            future = dcp.async_save(
                layout.state_dict(), checkpoint_id=str(tmp), process_group=self.group, async_stager=self.stager
            )
            self.pending = (future, tmp, final, progress)
        else:
            _on_every_rank(final, lambda: dcp.save(layout.state_dict(), checkpoint_id=str(tmp)))
            self._complete(tmp, final, progress)
        return final

    def wait(self) -> Path | None:
        """Finish an async save in flight (collective); returns its folder."""
        if self.pending is None:
            return None
        future, tmp, final, progress = self.pending
        self.pending = None
        _on_every_rank(final, future.result, self.group)
        self._complete(tmp, final, progress)
        return final

    def close(self) -> None:
        """At the end of the run: the save in flight finished, the pinned buffers released."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _complete(self, tmp: Path, final: Path, progress: dict) -> None:
        def publish() -> None:
            if dist.get_rank() == 0:
                _write(progress, tmp / PROGRESS)  # written last: its presence marks a complete checkpoint
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
                for old in list_checkpoints(self.root)[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)

        _on_every_rank(final, publish, self.group)  # also the barrier after which the checkpoint is complete


def load(path: Path, parts: dict[str, Stateful]) -> None:
    """Collective: every part restored in place from the checkpoint at `path`. A part the checkpoint does not hold,
    or whose saved state it cannot take (errors.StateMisfit: another FP8 recipe's, say), keeps its own; the second is
    named in a warning. The checkpoint was checked before (resolve_resume); what fails here is garbled inside a
    shard."""
    rank, progress = dist.get_rank(), _progress(path)
    layout, state = parts["layout"], parts["layout"].state_dict()
    fix = f"move it out of {path.parent}: checkpoint.resume=auto then takes the one before"
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as exc:  # raised on every rank alike
        error = CheckpointError(f"checkpoint {path} could not be read ({failure_text(exc)}); {fix}")
        raise_on_every_rank(error, rank == 0)
    layout.load_state_dict(state)
    parts["progress"].load_state_dict(progress)
    for name, part in parts.items():
        if name in OWN:
            continue
        try:
            saved = _saved(path, progress, name, rank)
        except Exception as exc:  # noqa: BLE001 - a cut or garbled file fails in many ways
            raise CheckpointError(
                f"checkpoint {path}: the {name} state could not be read ({brief(exc)}); {fix}"
            ) from None
        if saved is None:
            continue
        try:
            part.load_state_dict(saved)
        except StateMisfit as exc:
            if rank == 0:
                print(
                    f"flux-train: warning: checkpoint {path}: its {name} state does not fit this run ({exc}); this "
                    f"run's {name} starts afresh",
                    file=sys.stderr,
                    flush=True,
                )


def _saved(path: Path, progress: dict, part: str, rank: int) -> dict | None:
    """This rank's saved state of a per-rank `part`, or None where the checkpoint holds none."""
    if part in progress.get("parts", EARLIER_PARTS):
        return torch.load(path / rank_file(part, rank), weights_only=True)
    if part == "precision":  # a checkpoint written before the parts had names: the FP8 scales in progress.pt
        return progress.get("fp8")
    return None
