"""MLLOG events through mlperf-logging, from rank 0 only (docs/benchmark.md, "MLPerf log")."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Callable

from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger as _MLPerfLogger

from flux_train.config import EVAL_SAMPLES, TRAIN_SAMPLES, Config, accumulation_steps
from flux_train.errors import StorageError
from flux_train.private_apis import rcp_records

# the MLPerf rules our logs follow: the checkers' usage, ruleset and benchmark names
USAGE, RULESET, BENCHMARK = "training", "6.0.0", "flux1"


def rcp_samples(gbs: int) -> list[int]:
    """Samples to converge of each MLPerf reference run at this global batch size ([]: the RCPs have none)."""
    records = rcp_records(USAGE, RULESET, BENCHMARK).values()
    return next((r["samples to converge"] for r in records if r["BS"] == gbs), [])


EVALUATION_FREQUENCY = "evaluation_frequency"  # no constant in mlperf_logging; the reference logs the literal
TOKEN = ":::MLLOG"


def parse(line: str) -> dict | None:
    """The record of one MLLOG line (text before the token, e.g. a rank prefix, is ignored, as the checkers do);
    None for any other line, or one cut short."""
    if TOKEN not in line:
        return None
    with contextlib.suppress(json.JSONDecodeError):
        record = json.loads(line.split(TOKEN, 1)[1])
        return record if isinstance(record, dict) else None
    return None


def read_records(path: Path) -> list[dict]:
    """The MLLOG records of a log file ([] when there is none)."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    return [r for r in map(parse, text.splitlines()) if r is not None]


def samples_count(record: dict) -> int:
    """The samples a record counts (0 for those that count none: the ones before training)."""
    metadata = record.get("metadata")
    count = metadata.get("samples_count") if isinstance(metadata, dict) else None
    return count if isinstance(count, int) else 0


class _RaisingFileHandler(logging.FileHandler):
    """A write that fails (a full disk) raises, where logging's own handler prints a traceback and goes on without
    the record: a run whose MLLOG lost a line has no valid log."""

    def handleError(self, record: logging.LogRecord) -> None:
        raise  # called from within emit's except block: re-raises the write's error


class MLLogger:
    """Thin wrapper: no-ops on ranks other than 0; the run's file, and stdout too when asked (as the MLPerf
    recipes print it in their Slurm logs)."""

    def __init__(self, path: Path, enabled: bool, append: bool = False, stdout: bool = False):
        """A fresh run starts a fresh file. A resumed one (`append`: its log already cut back to its checkpoint by
        run_folder.claim) continues it (`continued`), unless it holds no run_start: then it starts afresh."""
        self.enabled, self.path = enabled, path
        self.continued = self.in_block = False
        if not enabled:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = read_records(path) if append else []
            self.continued = any(r.get("key") == C.RUN_START for r in kept)
            if not self.continued:
                path.unlink(missing_ok=True)
            blocks = [r["key"] for r in kept if r.get("key") in (C.BLOCK_START, C.BLOCK_STOP)]
            self.in_block = bool(blocks) and blocks[-1] == C.BLOCK_START  # the checkpoint was saved within a block
            handler = _RaisingFileHandler(path)
        except OSError as exc:
            raise StorageError(f"writing {path} failed ({exc})") from None
        logger = logging.getLogger("flux_train.outputs.mllog")  # ours, not mlperf-logging's (which prints to stdout)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for old in list(logger.handlers):  # an earlier run in this process
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        if stdout:
            logger.addHandler(logging.StreamHandler(sys.stdout))
        self._log = _MLPerfLogger(logger, default_stack_offset=3)  # 3: the caller of event/start/end, past _write

    def _write(self, method, key: str, value, metadata: dict) -> None:
        try:
            method(key=key, value=value, metadata=metadata or None)
        except OSError as exc:
            raise StorageError(f"writing {self.path} failed ({exc})") from None

    def event(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self._write(self._log.event, key, value, metadata)

    def start(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self._write(self._log.start, key, value, metadata)

    def end(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self._write(self._log.end, key, value, metadata)

    def run_parameters(self, cfg: Config, world_size: int) -> None:
        """Everything the checker wants before run_start, with init_start last."""
        t, lg = cfg.train, cfg.logging
        for key, value in (
            (C.CACHE_CLEAR, True),
            (C.SUBMISSION_BENCHMARK, C.FLUX1),
            (C.SUBMISSION_DIVISION, lg.submission_division),
            (C.SUBMISSION_ORG, lg.submission_org),
            (C.SUBMISSION_PLATFORM, lg.submission_platform),
            (C.SUBMISSION_POC_NAME, lg.submission_poc_name),
            (C.SUBMISSION_POC_EMAIL, lg.submission_poc_email),
            (C.SUBMISSION_STATUS, lg.submission_status),
            (C.TRAIN_SAMPLES, TRAIN_SAMPLES),
            (C.EVAL_SAMPLES, EVAL_SAMPLES),
            (C.SEED, t.seed),
            (C.GLOBAL_BATCH_SIZE, t.global_batch_size),
            ("micro_batch_size", t.micro_batch_size),
            (C.OPT_NAME, "adamw"),
            (C.OPT_BASE_LR, t.lr),
            (C.OPT_LR_WARMUP_STEPS, t.warmup_steps),
            (C.OPT_ADAMW_BETA_1, t.adam_beta1),
            (C.OPT_ADAMW_BETA_2, t.adam_beta2),
            (C.OPT_ADAMW_EPSILON, t.adam_eps),
            (C.OPT_ADAMW_WEIGHT_DECAY, t.weight_decay),
            (C.OPT_GRADIENT_CLIP_NORM, t.grad_clip_norm),
            (C.GRADIENT_ACCUMULATION_STEPS, accumulation_steps(cfg, world_size)),
            # the rule's sample cadence (262144); a debug run's eval.every_steps does not change what is logged
            (EVALUATION_FREQUENCY, cfg.eval.every_samples),
        ):
            self.event(key, value)

    # the training loop's events, in one place

    @contextlib.contextmanager
    def block(self, samples: Callable[[], int]):
        """block_start now and block_stop when the block's steps end (an exception ends the run without it);
        `samples` gives the samples count at each."""
        self.block_start(samples())
        yield
        self.block_stop(samples())

    def block_start(self, samples: int) -> None:
        """Opens a block, unless one is open: a run resumed from a checkpoint saved within a block continues it."""
        if not self.in_block:
            self.start(C.BLOCK_START, samples_count=samples)
        self.in_block = True

    def block_stop(self, samples: int) -> None:
        self.end(C.BLOCK_STOP, samples_count=samples)
        self.in_block = False

    def eval_start(self, samples: int) -> None:
        self.start(C.EVAL_START, samples_count=samples)

    def eval_result(self, val_loss: float, samples: int) -> None:
        self.event(C.EVAL_ACCURACY, val_loss, samples_count=samples)
        self.end(C.EVAL_STOP, samples_count=samples)

    def run_stop(self, status: str, samples: int) -> None:
        self.end(C.RUN_STOP, status=status, samples_count=samples)
