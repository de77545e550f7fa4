"""Which ranks did not arrive: every rank keeps a small file in the run folder fresh, so that when a collective
times out the ranks that wait can name the one that stopped.

A background thread rewrites `<out_dir>/heartbeats/rank_00003` ("<step> <phase> <host> <unix time>") every few
seconds with what the loop last reported (`beat`, no I/O on the training thread). A rank that is stopped, hung
or dead stops refreshing its file; a rank that is alive but held up elsewhere keeps refreshing it with an older
step or phase. The run folder is shared by all nodes.

The heartbeat ends with the loop; what follows it (tearing down the process group, the checkpoint writer, the
loader's workers) is watched by an `ExitDeadline`: a rank still there after `parallel.exit_timeout_s` says
where it waits and ends (exit 6), so a job whose training is done does not hold its nodes until the time limit.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dataprep.staging import write_atomic

INTERVAL_S = 2.0
EXIT_HUNG = 6  # the run ended, but its process did not (a hung teardown)
STDERR_FD = 2  # faulthandler writes to a descriptor: the process's stderr, also where sys.stderr is replaced


def node_name() -> str:
    """This node as Slurm names it (what `submit --exclude` takes), else its hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    phase: str
    host: str
    time: float


class Heartbeat:
    def __init__(self, folder: Path, rank: int, interval_s: float = INTERVAL_S):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank_{rank:05d}"
        self.host = node_name()
        self.state = (0, "init")
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(interval_s,), name="flux-heartbeat", daemon=True)
        self.thread.start()

    def beat(self, step: int, phase: str) -> None:
        self.state = (step, phase)

    def _run(self, interval_s: float) -> None:
        while not self.stopped.is_set():
            step, phase = self.state
            try:  # replaced whole: readers never see half a line
                write_atomic(self.path, f"{step} {phase} {self.host} {time.time():.1f}\n")
            except OSError:
                pass  # a full or vanished run folder is reported elsewhere; the heartbeat is best effort
            self.stopped.wait(interval_s)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def read(folder: Path) -> list[Beat]:
    beats = []
    for f in sorted(folder.glob("rank_*")):
        if f.suffix:
            continue
        try:
            step, phase, host, when = f.read_text().split()
        except (OSError, ValueError):
            continue
        beats.append(Beat(int(f.name.split("_")[1]), int(step), phase, host, float(when)))
    return beats


def stragglers(folder: Path, world: int, interval_s: float = INTERVAL_S) -> str:
    """A sentence naming the ranks that stopped (no fresh heartbeat) or lag behind the others."""
    now = time.time()
    beats = {b.rank: b for b in read(folder)}
    silent = [b for b in beats.values() if now - b.time > 3 * interval_s]
    alive = [b for b in beats.values() if b not in silent]
    front = max(((b.step, b.phase) for b in alive), default=None)
    parts = [
        f"rank {b.rank} on {b.host} has been silent for {now - b.time:.0f} s (stopped, hung or dead; last at "
        f"step {b.step}, {b.phase})"
        for b in sorted(silent, key=lambda b: b.rank)
    ]
    parts += [
        f"rank {b.rank} on {b.host} is at step {b.step} ({b.phase}), behind step {front[0]} ({front[1]})"
        for b in sorted(alive, key=lambda b: b.rank)
        if front and (b.step, b.phase) != front
    ]
    parts += [f"rank {r} never reported" for r in sorted(set(range(world)) - set(beats))]
    return "; ".join(parts) if parts else "every rank is alive at the same step: the collective itself stalled"


class ExitDeadline:
    """Armed when a rank's run has ended, cancelled when its teardown is done: if that takes `seconds`, one line names the rank and
    the frame its main thread waits in, every thread's stack follows on stderr, and the process ends with
    EXIT_HUNG. The timer thread needs the GIL; a wait in C code that holds it is ended by faulthandler's own
    (GIL-free) timer 30 s later, with the stacks and exit code 1."""

    BACKSTOP_S = 30

    def __init__(self, seconds: float, rank: int, ended: str):
        self.seconds, self.rank, self.ended = seconds, rank, ended
        self.main = threading.get_ident()
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True
        self.timer.name = "flux-exit-deadline"
        self.timer.start()
        faulthandler.dump_traceback_later(seconds + self.BACKSTOP_S, exit=True, file=STDERR_FD)

    def _expire(self) -> None:
        frame = sys._current_frames().get(self.main)
        print(
            f"flux-train: rank {self.rank} on {node_name()}: the run ended ({self.ended}) but the process had not "
            f"exited {self.seconds:g} s later; it waits in {where(frame)}; ending it (exit {EXIT_HUNG}; stacks "
            "follow; parallel.exit_timeout_s sets the wait)",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=STDERR_FD, all_threads=True)
        os._exit(EXIT_HUNG)

    def cancel(self) -> None:
        """The teardown finished in time."""
        self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def where(frame) -> str:
    """The innermost frame, and the innermost of flux-train's own if that is another: `fn (file:line)`."""
    if frame is None:
        return "an unknown place (the main thread has ended)"
    inner = f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
    ours = frame
    while ours is not None and f"{os.sep}flux_train{os.sep}" not in ours.f_code.co_filename:
        ours = ours.f_back
    if ours is None or ours is frame:
        return inner
    return f"{inner}, called from {ours.f_code.co_name} ({ours.f_code.co_filename}:{ours.f_lineno})"
