"""One training worker, as the per-node agent (flux_train.launch) starts it once per GPU:

    python -m flux_train.worker --config CONFIG

flux_train.train's main, then an exit that skips the interpreter's teardown. A worker that has finished its
work must not fail the job: at teardown, C++ objects that outlive destroy_process_group (gloo's threads,
still referenced from FSDP's device mesh) can abort the process ("terminate called without an active
exception", SIGABRT), which the agent would report as a failed worker and Slurm as a FAILED job. So once
main has returned, the logs are flushed and the process leaves with main's exit code. An exception still
ends it the usual way: a traceback and exit code 1.
"""

from __future__ import annotations

import logging
import os
import sys

from flux_train import train


def main() -> None:
    code = train.main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
