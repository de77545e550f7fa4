"""The preemption contract, in one place: how a Slurm job about to reach its time limit saves its state and
comes back.

1. Slurm sends SIGNAL (USR2) to every node's agent `slurm.signal_delay_s` seconds before the limit: sbatch's
   `--signal`, which flux_train.cluster.submit sets and which, for the plain `sbatch slurm/flux.sbatch` path,
   `python -m flux_train.training.preemption --config CONFIG` prints.
2. The agent (flux_train.cluster.launch) passes it on to its workers. A worker notes it and acts at the next logging
   boundary (every logging.log_every steps, where the ranks agree on stopping without an extra sync): it
   saves a checkpoint and exits with EXIT_CODE.
3. The agent sees its workers stop that way and creates the file named by $REQUEUE_FLAG_ENV.
4. The batch script's teardown (slurm/requeue.sh, sourced right after srun on the batch host, where Slurm's
   client is; a container needs none) finds that file and runs `scontrol requeue`. The requeued job resumes
   from the latest checkpoint (checkpoint.resume=auto).

So the lead time must cover up to log_every steps, one checkpoint save, and slack.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

from flux_train.errors import reports_user_errors

SIGNAL = signal.SIGUSR2
EXIT_CODE = 75  # EX_TEMPFAIL: saved a checkpoint on SIGNAL and stopped; the job requeues
REQUEUE_FLAG_ENV = "FLUX_REQUEUE_FLAG"
REQUEUE_SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "requeue.sh"


def sbatch_options(signal_delay_s: int) -> list[str]:
    return ["--requeue", f"--signal={SIGNAL.name.removeprefix('SIG')}@{signal_delay_s}"]


def teardown() -> list[str]:
    """The batch script's lines after srun: srun's exit status stays the job's."""
    return [f"source {shlex.quote(str(REQUEUE_SCRIPT))}"]


@reports_user_errors
def main(argv=None) -> int:
    from flux_train.cli import preemption_parser
    from flux_train.config import load_config

    args = preemption_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    print(shlex.join(sbatch_options(cfg.slurm.signal_delay_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
