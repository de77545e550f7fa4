"""Results of a set of runs: score, samples to converge, compliance and RCP verdicts, a val-loss plot.

`python -m flux_train.results RUN_DIR... [--out DIR] [--json]`. Per run: time-to-train (run_stop - run_start),
status, samples to converge, evals, last val loss and the official compliance checker's verdict. Across runs:
the MLPerf score (olympic mean of 10 runs), samples to converge, the official RCP checker's verdict, and a PNG
of val loss against samples. Exit status 1 if a log is unreadable or fails compliance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from mlperf_logging.benchmark_meta import get_result_file_counts

from flux_train.cli import results_parser
from flux_train.config import TARGET_VAL_LOSS
from flux_train.errors import UserError, reports_user_errors, write_output
from flux_train.outputs.mllog import BENCHMARK, RULESET, USAGE, read_records
from flux_train.outputs.report import draw_val_loss
from flux_train.private_apis import compliance_check, rcp_batch_sizes, rcp_check

RUNS_PER_SCORE = get_result_file_counts(USAGE)[BENCHMARK]  # 10
NOT_CONVERGED = 1e9  # samples the RCP checker counts for a run that did not succeed
MLLOG_FILE = "mllog.log"
PLOT_FILE = "val_loss.png"


@dataclass
class Compliance:
    passed: bool
    failed_keys: list[str]  # the log keys the checker's messages name
    messages: list[str]  # one line per failed rule
    warnings: list[str]  # what the checker warns about without failing


@dataclass
class Run:
    name: str
    log: Path
    error: str | None = None  # why the log could not be read
    status: str = "incomplete"  # run_stop's status; "incomplete" when there is no run_stop
    minutes: float | None = None  # time-to-train
    samples_to_converge: float = NOT_CONVERGED
    global_batch_size: int | None = None
    evals: list[tuple[int | None, float]] = field(default_factory=list)  # (samples_count, val loss)
    compliance: Compliance | None = None

    @property
    def counts(self) -> bool:
        """Scored: converged, with a compliant log (the result summarizer drops a run whose log fails compliance,
        which for flux1 includes every run that never reached 0.586)."""
        compliant = self.compliance is not None and self.compliance.passed
        return compliant and self.status == "success" and self.minutes is not None


@dataclass
class Score:
    minutes: float | None
    averaged: int  # runs in the mean
    note: str  # what was computed, and whether it is an MLPerf score


@dataclass
class Samples:
    runs: int
    mean: float | None
    olympic_mean: float | None  # what the RCP checker compares with the RCP
    not_converged: int


@dataclass
class Rcp:
    verdict: str  # passed, failed, not run, error
    message: str
    scaling_factor: float | None = None  # RCP mean / submission mean, >= 1; the score is multiplied by it
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- one run


def find_logs(paths: list[str]) -> list[tuple[str, Path]]:
    """(name, log) per run: a log file, a folder with mllog.log, a folder of result_*.txt (one run each), or a
    campaign folder whose subfolders hold one run each."""
    found = []
    for p in map(Path, paths):
        if not p.exists():
            raise UserError(f"{p} does not exist: give a run's out_dir, a folder of result_*.txt or a log file")
        results = sorted(p.glob("result_*.txt"), key=lambda f: (len(f.name), f.name)) if p.is_dir() else []
        runs = sorted(d for d in p.iterdir() if (d / MLLOG_FILE).is_file()) if p.is_dir() else []
        if p.is_dir() and (p / MLLOG_FILE).is_file():
            found.append((str(p), p / MLLOG_FILE))
        elif results:
            found += [(str(f), f) for f in results]
        elif runs:  # a campaign folder (python -m flux_train.submit --runs N): one run folder each
            found += [(str(d), d / MLLOG_FILE) for d in runs]
        else:
            found.append((str(p), p))  # a log file, or nothing readable: read_events says which
    return found


class UnreadableLog(Exception):
    pass


def read_events(log: Path) -> list[dict]:
    """MLLOG records of a log; text before ':::MLLOG' (a rank prefix) is ignored, as the checkers do."""
    if not log.is_file():
        raise UnreadableLog(f"not a log file, nor a folder with {MLLOG_FILE} or result_*.txt")
    events = read_records(log)  # a line cut short by a crash is skipped here; the compliance checker reports it
    if not events:
        raise UnreadableLog("no MLLOG lines")
    return events


def summarize_run(name: str, log: Path) -> Run:
    run = Run(name, log)
    try:
        _fill(run, read_events(log))
    except (OSError, UnreadableLog) as exc:
        run.error = str(exc)
        return run
    run.compliance = check_compliance(log)
    return run


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def malformed(record: dict) -> str | None:
    """What in a record would stop the summary (a value of the wrong type, as a hand-edited log may hold)."""
    meta = record.get("metadata", {})
    if not isinstance(record.get("key"), str):
        return "no key"
    if not _number(record.get("time_ms")):
        return f"time_ms {record.get('time_ms')!r} is not a number"
    if not isinstance(meta, dict):
        return f"metadata {meta!r} is not a mapping"
    count = meta.get("samples_count")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        return f"samples_count {count!r} is not a count"
    value = record.get("value")
    if record["key"] == "eval_accuracy" and not _number(value):
        return f"value {value!r} is not a number"
    if record["key"] == "global_batch_size" and not (isinstance(value, int) and not isinstance(value, bool)):
        return f"value {value!r} is not a whole number"
    return None


def _fill(run: Run, events: list[dict]) -> None:
    """Time-to-train, status, evals and samples to converge, read up to the first run_stop."""
    start = stop = None
    for n, e in enumerate(events, 1):
        problem = malformed(e)
        if problem:
            raise UnreadableLog(f"MLLOG record {n} ({e.get('key', '?')}): {problem}")
        key, meta = e["key"], e.get("metadata") or {}
        if key == "global_batch_size":
            run.global_batch_size = e["value"]
        elif key == "run_start" and start is None:
            start = e["time_ms"]
        elif key == "eval_accuracy":
            run.evals.append((meta.get("samples_count"), e["value"]))
        elif key == "run_stop":
            run.status, stop = meta.get("status", "no status"), e["time_ms"]
            break
    if start is not None and stop is not None:
        run.minutes = (stop - start) / 60_000
    # the RCP checker's rule: samples_count of the last eval before a successful run_stop
    if run.status == "success" and run.evals and run.evals[-1][0] is not None:
        run.samples_to_converge = run.evals[-1][0]


def check_compliance(log: Path) -> Compliance:
    """The official compliance checker, in-process so that its failures stay keyed by log key."""
    with _captured_log():
        verdict = compliance_check(log, USAGE, RULESET)
    keyed = [f"{key}: {_brief(msg)}" for key, msg in verdict.by_key.items()]
    unkeyed = [_brief(msg) for msg in verdict.unkeyed]
    named = {key for msg in unkeyed for key in _keys_named(msg)}
    return Compliance(
        verdict.passed, sorted(set(verdict.by_key) | named), keyed + unkeyed, [_brief(m) for m in verdict.warnings]
    )


def _keys_named(message: str) -> list[str]:
    """Keys in the messages the checker does not key by log key (the rule's own code is not searched)."""
    if match := re.match(r"Failed checks for (\w+)", message):  # an AT_LEAST_ONE check no line passed
        return [match[1]]
    if message.startswith("Required"):  # "Required AT_LEAST_ONE occurrence of 'a' or 'b'"
        return re.findall(r"'(\w+)'", message)
    return []


def _brief(message: str) -> str:
    """The checker's first line and the failed test, without the log line and state dump it appends."""
    lines = message.strip().splitlines()
    return " ".join([lines[0], *(line for line in lines[1:] if line.startswith("failed test"))])


class _Collector(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().strip())


@contextlib.contextmanager
def _captured_log():
    """The checkers log to the root logger; collect it rather than let it reach stderr unasked."""
    collector = _Collector()
    root = logging.getLogger()
    root.addHandler(collector)
    try:
        yield collector
    finally:
        root.removeHandler(collector)


# ---------------------------------------------------------------------------------------------- across runs


def counted(n: int, thing: str) -> str:
    """'1 run', '3 runs'."""
    return f"{n} {thing}{'' if n == 1 else 's'}"


def mlperf_score(runs: list[Run]) -> Score:
    """Olympic mean of time-to-train as the result summarizer computes it: a run that did not converge or failed
    compliance is dropped as the slowest; with more than one such run there is no score."""
    ok = sorted((r for r in runs if r.counts), key=lambda r: r.minutes or 0.0)  # counted runs have minutes
    bad = [r.name for r in runs if not r.counts]
    if len(bad) > 1:
        return Score(
            None,
            0,
            f"no score: {len(bad)} runs did not converge or failed compliance ({', '.join(bad)}); at most one may",
        )
    kept = ok[1 : len(ok) - 1 + len(bad)]
    if kept:
        slowest = f"{bad[0]}, not converged or not compliant" if bad else ok[-1].name
        how = f"olympic mean of {len(kept)}: dropped the fastest ({ok[0].name}) and the slowest ({slowest})"
    elif ok:
        kept, how = ok, f"plain mean of {len(ok)}: too few runs to drop the fastest and slowest"
    else:
        return Score(None, 0, "no score: no run converged with a compliant log")
    if len(runs) != RUNS_PER_SCORE:
        how = f"NOT an MLPerf score ({counted(len(runs), 'run')} given, flux1 needs {RUNS_PER_SCORE}); {how}"
    return Score(statistics.fmean(r.minutes or 0.0 for r in kept), len(kept), how)


def samples_to_converge(runs: list[Run]) -> Samples:
    samples = sorted(r.samples_to_converge for r in runs if r.error is None)
    olympic = samples[1:-1]
    return Samples(
        len(samples),
        statistics.fmean(samples) if samples else None,
        statistics.fmean(olympic) if olympic else None,
        sum(s == NOT_CONVERGED for s in samples),
    )


def check_rcp(runs: list[Run]) -> Rcp:
    """The official RCP checker, on the readable logs copied as result_<i>.txt into a scratch folder (its layout)."""
    logs = [r.log for r in runs if r.error is None]
    if len(logs) < 3:
        return Rcp(
            "not run",
            f"{counted(len(logs), 'readable run')}: its olympic mean needs at least 3 (a submission has "
            f"{RUNS_PER_SCORE})",
        )
    notes = (
        []
        if len(logs) == RUNS_PER_SCORE
        else [
            f"{len(logs)} runs given: the checker's statistics assume {RUNS_PER_SCORE}, so this verdict is indicative only"
        ]
    )
    with tempfile.TemporaryDirectory() as tmp, _captured_log() as captured:
        for i, log in enumerate(logs):
            shutil.copy(log, Path(tmp) / f"result_{i}.txt")
        try:
            passed, message, factor = rcp_check(Path(tmp), USAGE, RULESET)
        except Exception as exc:  # e.g. no submission_benchmark, or an eval_accuracy without samples_count
            return Rcp("error", f"the checker raised {type(exc).__name__}: {exc}", notes=notes)
    notes += list(dict.fromkeys(captured.lines))  # its warnings, e.g. "Batch sizes in files do not match."
    if message.startswith("Missing RCP"):
        sizes = ", ".join(map(str, rcp_batch_sizes(USAGE, RULESET, BENCHMARK)))
        notes.append(
            f"{BENCHMARK} {RULESET} has RCPs for GBS {sizes}: a smaller GBS is "
            f"judged against the smallest (debug runs cannot pass), a larger one needs new RCPs"
        )
    # the factor only applies to a passing set (a mean within the allowed speed-up of the RCP)
    return Rcp("passed" if passed else "failed", message, float(factor) if passed else None, notes)


def plot_val_loss(runs: list[Run], path: Path) -> None:
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.subplots()
    draw_val_loss(ax, {run.name: [(s, v) for s, v in run.evals if s is not None] for run in runs}, TARGET_VAL_LOSS)
    ax.set_title(f"flux1 validation loss, {len(runs)} run(s)")
    write_output(path, "--out", lambda p: fig.savefig(p, dpi=120, format="png"))


# ---------------------------------------------------------------------------------------------- output


def problems(runs: list[Run]) -> list[str]:
    """What makes the exit status non-zero: unreadable logs and compliance failures."""
    found = []
    for r in runs:
        if r.error:
            found.append(f"{r.name}: unreadable: {r.error}")
        elif r.compliance is not None and not r.compliance.passed:
            found.append(f"{r.name}: fails compliance: {'; '.join(r.compliance.messages)}")
    return found


def run_json(run: Run) -> dict:
    d = dataclasses.asdict(run)
    d.update(
        log=str(run.log),
        n_evals=len(run.evals),
        last_val_loss=run.evals[-1][1] if run.evals else None,
        converged=run.samples_to_converge != NOT_CONVERGED,
    )
    return d


def print_table(runs: list[Run]) -> None:
    width = max(len(r.name) for r in runs)
    print(f"{'run':<{width}}  {'status':<10} {'minutes':>9} {'samples':>13} {'evals':>5} {'last val':>9}  compliance")
    for r in runs:
        if r.error or r.compliance is None:  # a log that was read has its compliance result
            print(f"{r.name:<{width}}  unreadable: {r.error}")
            continue
        minutes = f"{r.minutes:.3f}" if r.minutes is not None else "-"
        samples = f"{r.samples_to_converge:,.0f}" if r.samples_to_converge != NOT_CONVERGED else "not conv."
        last = f"{r.evals[-1][1]:.4f}" if r.evals else "-"
        verdict = "passed" if r.compliance.passed else "FAILED: " + ", ".join(r.compliance.failed_keys or ["see below"])
        print(f"{r.name:<{width}}  {r.status:<10} {minutes:>9} {samples:>13} {len(r.evals):>5} {last:>9}  {verdict}")


def print_summary(runs: list[Run], score: Score, samples: Samples, rcp: Rcp, plot: Path) -> None:
    print_table(runs)
    for r in runs:
        if r.compliance:
            for line in r.compliance.messages + [f"warning: {w}" for w in r.compliance.warnings]:
                print(f"  {r.name}: {line}")
    print()
    minutes = f"{score.minutes:.3f} min" if score.minutes is not None else "-"
    print(f"score: {minutes}  [{score.note}]")
    if samples.mean is not None:
        olympic = f"; olympic mean {samples.olympic_mean:,.0f}" if samples.olympic_mean is not None else ""
        unconverged = (
            f"; {samples.not_converged} not converged, counted as 1e9 as the RCP checker does"
            if samples.not_converged
            else ""
        )
        runs_text = counted(samples.runs, "run")
        print(f"samples to converge: mean {samples.mean:,.0f} over {runs_text}{olympic}{unconverged}")
    compliant = sum(1 for r in runs if r.compliance and r.compliance.passed)
    print(f"compliance checker ({USAGE} {RULESET}): {compliant}/{len(runs)} logs pass")
    factor = (
        f"; scaling factor {rcp.scaling_factor:.4f} (the score is multiplied by it)"
        if rcp.scaling_factor not in (None, 1.0)
        else ""
    )
    print(f"RCP checker ({USAGE} {RULESET}, pruned RCPs): {rcp.verdict.upper()}: {rcp.message}{factor}")
    for note in rcp.notes:
        print(f"  {note}")
    print(f"plot: {plot}")


@reports_user_errors
def main(argv=None) -> int:
    args = results_parser().parse_args(argv)
    if args.out and args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file; give the folder that {PLOT_FILE} goes into")
    runs = [summarize_run(name, log) for name, log in find_logs(args.runs)]
    if all(r.error for r in runs):
        raise UserError("no readable MLLOG in " + ", ".join(f"{r.name} ({r.error})" for r in runs))
    score, samples, rcp = mlperf_score(runs), samples_to_converge(runs), check_rcp(runs)
    out = args.out or (Path(args.runs[0]) if len(args.runs) == 1 and Path(args.runs[0]).is_dir() else Path("."))
    plot = out / PLOT_FILE
    plot_val_loss(runs, plot)
    failures = problems(runs)
    if args.json:
        print(
            json.dumps(
                {
                    "runs": [run_json(r) for r in runs],
                    "score": dataclasses.asdict(score),
                    "samples_to_converge": dataclasses.asdict(samples),
                    "rcp": dataclasses.asdict(rcp),
                    "plot": str(plot),
                    "problems": failures,
                },
                indent=2,
            )
        )
    else:
        print_summary(runs, score, samples, rcp, plot)
    for line in failures:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
