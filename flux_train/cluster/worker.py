"""One training worker, as the per-node agent (flux_train.cluster.launch) starts it once per GPU:

    python -m flux_train.cluster.worker --config CONFIG

flux_train.training.train's main (handed eval.sample_prompts' sampler, flux_train.tools.sample, as the train command
does), then an exit that skips the interpreter's teardown. A worker that has finished its
work must not fail the job: at teardown, C++ objects that outlive destroy_process_group (gloo's threads,
still referenced from FSDP's device mesh) can abort the process ("terminate called without an active
exception", SIGABRT), which the agent would report as a failed worker and Slurm as a FAILED job. So once
main has returned, the logs are flushed and the process leaves with main's exit code. An exception still
ends it the usual way: a traceback and exit code 1. A worker of the agent ends when the agent does, also when
the agent was killed by SIGKILL (the parent-death signal, dataprep.lifetime).
"""

from __future__ import annotations

import logging
import os
import sys

from dataprep.lifetime import die_with_parent
from flux_train.cluster.launch import AGENT_PID_ENV


def main() -> None:
    if AGENT_PID_ENV in os.environ:  # first, before the seconds torch takes to import: no worker outlives its agent
        die_with_parent(int(os.environ[AGENT_PID_ENV]))
    from flux_train.tools.sample import Sampler
    from flux_train.training import train

    code = train.main(sys.argv[1:], sampler=Sampler.for_run)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
