"""Child processes that end with their parent, through Linux's parent-death signal (prctl PR_SET_PDEATHSIG): a
parent killed by SIGKILL can pass nothing on, so each child arms the signal itself, first thing. Used by convert's
pool and by flux_train's training workers and its `submit --local` agent (it lives here because flux_train
imports dataprep, not the reverse)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """Have the kernel send this process `signum` when its parent, pid `parent` (noted by the parent before it
    started this one), ends; when that has already happened, end now. Elsewhere than Linux: nothing."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    if os.getppid() != parent:  # the parent ended before the signal was armed: this one was reparented
        os.kill(os.getpid(), signum)
