"""tests/unit: fast tests, no training run, no compile over a few seconds, no Slurm or containers. Every test here is
marked `unit`; `python -m pytest tests/unit` is the quick loop, and it keeps to its budget (docs/testing.md): a test
that takes over TEST_S seconds fails, and so does the whole loop when it takes over LOOP_S.

A test's time is the smaller of its wall time and the CPU time it used (this process's threads and the children it
waited for), from its setup to the end of its call. A busy machine stretches wall time, a test waiting for a core,
but not the CPU time of the work the test does; a machine of many cores runs torch on more threads, whose CPU time
adds up beyond the wall time, which it does not stretch. The smaller of the two grows only when a test does more,
so the limits fail on that, not on the machine's load or size. Where both grow (a loaded machine of many cores)
the limits' margin absorbs it: a test's is twice the slowest's (5 s), the loop's half again what it takes (59 s on
the 2-core CI machine, 2026-11-27)."""

import os
import resource
import time
from pathlib import Path

import pytest

TEST_S = 10.0  # one test, its setup (module fixtures too) and its call
LOOP_S = 90.0  # `python -m pytest tests/unit`, from the interpreter's start (collection too) to its end
UNIT = Path(__file__).resolve().parent
IMPORTED = time.monotonic()
STARTED = pytest.StashKey[tuple[float, float]]()
LOOP = pytest.StashKey[str]()  # the loop's time, as printed last


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.unit)


def cpu_seconds() -> float:
    """CPU time used so far by this process's threads and by the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def process_wall_seconds() -> float:
    """Wall time since this process started (Linux: /proc), else since this file was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        stat = Path("/proc/stat").read_text().splitlines()
        boot = next(float(line.split()[1]) for line in stat if line.startswith("btime"))
        return time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return time.monotonic() - IMPORTED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[STARTED] = (time.monotonic(), cpu_seconds())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or STARTED not in item.stash:
        return
    wall, cpu = item.stash[STARTED]
    took = min(time.monotonic() - wall, cpu_seconds() - cpu)
    if took > TEST_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {took:.1f} s (the smaller of wall and CPU time), over a unit test's {TEST_S:g} s "
            "(tests/unit/conftest.py): make it faster, or move it to tests/runs if it runs something end to end"
        )


def whole_loop(session) -> bool:
    """Whether this session is the quick loop: tests/unit and nothing else, every test of it selected."""
    config = session.config
    chosen = [config.getoption(name, None) for name in ("keyword", "markexpr", "deselect", "lf")]
    given = [(config.invocation_params.dir / a).resolve() for a in config.args]
    return not any(chosen) and given == [UNIT] and session.testscollected > 0


def pytest_sessionfinish(session):
    if not whole_loop(session) or session.shouldstop:
        return
    wall, cpu = process_wall_seconds(), cpu_seconds()
    took = min(wall, cpu)
    line = f"the unit loop took {took:.0f} s (wall {wall:.0f} s, CPU {cpu:.0f} s), its budget {LOOP_S:g} s"
    if took > LOOP_S:
        line += ": over it (tests/unit/conftest.py); move what is slow to tests/runs"
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[LOOP] = line


def pytest_terminal_summary(terminalreporter, config):
    if LOOP in config.stash:
        terminalreporter.write_line(config.stash[LOOP])
