"""The run folder (logging.out_dir, and checkpoint.dir wherever it is), claimed by the main rank before the
run writes anything there: one run at a time (dataprep.folder_lock), no symbolic link written through, a finished
run not started again (unless a kill cut its final checkpoint, which is then completed), the checkpoint to resume
from chosen once for every rank, and the records of a resumed run (mllog.log, metrics.jsonl) cut back to that
checkpoint, so that each step and each eval is written once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from dataprep.folder_lock import LOCK_FILE, FolderLock, FolderLockError, lock_folder
from dataprep.staging import write_atomic
from flux_train.config import Config, ConfigError, checkpoint_dir
from flux_train.errors import StorageError, UserError, raise_on_every_rank
from flux_train.masking import masked
from flux_train.outputs.mllog import C, parse, read_records, samples_count
from flux_train.outputs.report import METRICS_FILE, REPORT_FILE
from flux_train.training import checkpoint


@dataclass
class Claim:
    resume_from: Path | None
    final_step: int | None = None  # a finished run's final checkpoint to complete (cut_final), not a run to go on


HELD: list[FolderLock] = []  # the run folders' locks this process holds (main rank only), until release()


def release() -> None:
    """Let go of the run folders this process claimed (at the end of the run, however it ended): their lock files
    go, and the folders they created if the run wrote nothing there (a start that failed, e.g. on its data)."""
    while HELD:
        HELD.pop().release()  # the checkpoint folder (inside the run's, by default) first


def claim(cfg: Config, rank: int, world_size: int) -> Claim:
    """Collective: the main rank claims the folder and decides the resume; a refusal ends every rank, with its one
    line from the main rank."""
    mine, error = Claim(None), None
    if rank == 0:
        try:
            mine = _claim(cfg, world_size)
        except UserError as exc:
            error = exc
    if world_size > 1:
        shared = [mine.resume_from, mine.final_step, error]
        dist.broadcast_object_list(shared, src=0)
        if rank != 0:
            mine, error = Claim(shared[0], shared[1]), shared[2]
    if error is not None:
        raise_on_every_rank(error, rank == 0)
    return mine


def _claim(cfg: Config, world_size: int) -> Claim:
    out, ckpt = Path(cfg.logging.out_dir), checkpoint_dir(cfg)
    log = out / cfg.logging.mllog_file
    if log.name in (LOCK_FILE, METRICS_FILE, REPORT_FILE, "config.yaml"):  # the log would replace it
        raise ConfigError(f"logging.mllog_file: {log.name} is another file of the run folder; name the log mllog.log")
    # both, wherever the checkpoints are: another run with its own out_dir must not save into this one's
    folders = {"logging.out_dir": out, "checkpoint.dir": ckpt}
    for folder in folders.values():  # before the locks, which would write their files through a linked folder
        refuse_links(folder)
    try:
        for key, folder in folders.items():
            HELD.append(lock_folder(folder, key))
    except FolderLockError as exc:
        release()
        raise ConfigError(str(exc)) from None
    resume_from = checkpoint.resolve_resume(cfg, world_size)
    gbs = cfg.train.global_batch_size
    step = checkpoint.read_progress(resume_from).step if resume_from else None
    resume_samples = None if step is None else step * gbs
    records = read_records(log) if cfg.checkpoint.resume != "none" else []
    final_step = cut_final(cfg, records, ckpt)
    if final_step is None and finished(records, resume_samples, cfg.train.max_steps * gbs):
        raise ConfigError(
            f"{out} holds a finished run (run_stop in {log.name}); choose a new logging.out_dir, or set "
            "checkpoint.resume=none to start over in this one"
        )
    cut = None if final_step is None else checkpoint.staging_of(checkpoint.step_folder(ckpt, final_step))
    checkpoint.remove_leftovers(ckpt, keep=cut)
    if step is not None and final_step is None:  # resuming
        cut_back(log, _samples_of, step * gbs)
        cut_back(out / METRICS_FILE, _step_of, step)
    elif records and final_step is None:  # an earlier start that saved nothing: say what happens to it
        print(
            f"flux-train: {out} holds a run stopped before its first checkpoint: starting over at step 0 "
            f"({log.name} and {METRICS_FILE} begin again)",
            flush=True,
        )
    return Claim(resume_from, final_step)


def next_start(cfg: Config) -> str:
    """What the same command does with the folder as it is now: where it resumes, or that it starts over."""
    choice = cfg.checkpoint.resume
    if choice == "none":
        return "starts over (checkpoint.resume=none)"
    if choice != "auto":
        return f"resumes from {choice} (checkpoint.resume)"
    found = checkpoint.list_checkpoints(checkpoint_dir(cfg))
    return (
        f"resumes from step {checkpoint.read_progress(found[-1]).step}" if found else "starts over: no checkpoint yet"
    )


def cut_final(cfg: Config, records: list[dict], ckpt: Path) -> int | None:
    """The step of a finished run's final checkpoint (checkpoint.final, saved after run_stop) that a kill cut: its
    save's staging folder is there and the checkpoint is not. None where there is none to complete."""
    stop = next((r for r in records if r.get("key") == C.RUN_STOP), None)
    if stop is None or not cfg.checkpoint.final:
        return None
    step = samples_count(stop) // cfg.train.global_batch_size
    final = checkpoint.step_folder(ckpt, step)
    cut = checkpoint.made_here(checkpoint.staging_of(final)) and not (final / checkpoint.PROGRESS).is_file()
    return step if cut else None


def refuse_links(folder: Path, depth: int = 2) -> None:
    """The run writes regular files and folders only: a symbolic link planted where it writes (metrics.jsonl ->
    /etc/..., heartbeats/rank_00000, checkpoints/step_00000010) would have it write elsewhere, so it is refused, not
    followed. Two levels deep, as deep as the run writes, whatever else a folder holds."""
    for entry in os.scandir(folder) if folder.is_dir() else ():
        path = Path(entry.path)
        if entry.is_symlink():
            raise ConfigError(
                f"{path} is a symbolic link (to {os.readlink(path)}); the run does not write through links in its "
                "folder: remove it (checkpoint.dir puts checkpoints elsewhere)"
            )
        if depth > 1 and entry.is_dir():
            refuse_links(path, depth - 1)


def finished(records: list[dict], resume_samples: int | None, cap_samples: int) -> bool:
    """Whether the log holds a run that ended with nothing left to do: a success, a stop with no checkpoint before
    it, or one at this run's step cap. A run stopped by a non-finite loss resumes from the checkpoint before the
    stop, whose record is cut away."""
    for r in records:
        if r.get("key") == C.RUN_STOP and (
            (r.get("metadata") or {}).get("status") == C.SUCCESS
            or resume_samples is None
            or samples_count(r) <= resume_samples
            or samples_count(r) >= cap_samples
        ):
            return True
    return False


def _samples_of(line: str) -> int | None:
    """Where an MLLOG line stands: the samples it counts (0 before training), None if it is not one."""
    record = parse(line)
    return None if record is None else samples_count(record)


def _step_of(line: str) -> int | None:
    """Where a metrics.jsonl row stands: its step, None if it is not one."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row.get("step") if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def cut_back(path: Path, position: Callable[[str], int | None], limit: int) -> None:
    """Keep the records of a file up to the first past `limit` (by `position`), dropping lines that are none (cut
    short or garbled); the file is replaced whole, so a crash here leaves the old one."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        at = position(line) if line.endswith("\n") else None
        if at is None:  # not a record, or one a crash or a full disk cut short
            continue
        if at > limit:
            break
        kept.append(line)
    try:
        write_atomic(path, "".join(kept))
    except OSError as exc:
        raise StorageError(f"writing {path} failed ({exc})") from None


def write_masked_config(cfg: Config) -> None:
    """The run's resolved config as config.yaml in its folder, secrets masked (env.masked_vars)."""
    config_file = Path(cfg.logging.out_dir) / "config.yaml"
    try:
        config_file.write_text(masked(cfg).to_yaml())
    except OSError as exc:
        raise StorageError(f"writing {config_file} failed ({exc})") from None
