"""MLLOG events through mlperf-logging, from rank 0 only (docs/benchmark.md, "MLPerf log")."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger as _MLPerfLogger

from flux_train.config import EVAL_SAMPLES, TRAIN_SAMPLES, Config, accumulation_steps

EVALUATION_FREQUENCY = "evaluation_frequency"  # no constant in mlperf_logging; the reference logs the literal


class MLLogger:
    """Thin wrapper: no-ops on ranks other than 0; the run's file, and stdout too when asked (as the MLPerf
    recipes print it in their Slurm logs)."""

    def __init__(self, path: Path, enabled: bool, append: bool = False, stdout: bool = False):
        """`append` keeps an earlier log (a resumed run); a fresh run starts a fresh file."""
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                path.unlink(missing_ok=True)
            logger = logging.getLogger("flux_train.mllog")  # ours, not mlperf-logging's (which prints to stdout)
            logger.setLevel(logging.INFO)
            logger.propagate = False
            for old in list(logger.handlers):  # an earlier run in this process
                logger.removeHandler(old)
                old.close()
            logger.addHandler(logging.FileHandler(path))
            if stdout:
                logger.addHandler(logging.StreamHandler(sys.stdout))
            self._log = _MLPerfLogger(logger, default_stack_offset=2)

    def event(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self._log.event(key=key, value=value, metadata=metadata or None)

    def start(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self._log.start(key=key, value=value, metadata=metadata or None)

    def end(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self._log.end(key=key, value=value, metadata=metadata or None)

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

    def block_start(self, samples: int) -> None:
        self.start(C.BLOCK_START, samples_count=samples)

    def block_stop(self, samples: int) -> None:
        self.end(C.BLOCK_STOP, samples_count=samples)

    def eval_start(self, samples: int) -> None:
        self.start(C.EVAL_START, samples_count=samples)

    def eval_result(self, val_loss: float, samples: int) -> None:
        self.event(C.EVAL_ACCURACY, val_loss, samples_count=samples)
        self.end(C.EVAL_STOP, samples_count=samples)

    def run_stop(self, status: str, samples: int) -> None:
        self.end(C.RUN_STOP, status=status, samples_count=samples)
