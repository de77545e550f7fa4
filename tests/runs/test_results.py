"""`python -m flux_train.results` on real logs: short debug trainings, and copies of them with rewritten
run_stop times, batch size or samples counts (to test the score arithmetic and the RCP verdicts exactly)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image
from mlperf_logging.rcp_checker import rcp_checker
from run_outputs import set_flags, train

from flux_train.outputs import results

pytestmark = pytest.mark.slow  # every test reads the training runs of the module fixture

MINUTES = [5, 1, 9, 3, 7, 2, 8, 4, 6, 50]  # olympic mean: drop 1 and 50, mean of 2..9 = 5.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A converged debug training and one stopped after its first eval (status aborted); other runs are copies."""
    root = tmp_path_factory.mktemp("runs")
    jobs = {"run_1": ["train.seed=1"], "aborted": ["train.seed=2", "train.max_steps=25"]}
    for name, overrides in jobs.items():
        proc = train(root / name, *set_flags(overrides), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def rewrite(log: Path, out: Path, edit) -> Path:
    """Copies `log` to `out`, each MLLOG record passed through edit(record) -> record, or None to drop it."""
    lines = []
    for line in log.read_text().splitlines():
        record = edit(json.loads(line.split(":::MLLOG ", 1)[1]))
        if record is not None:
            lines.append(":::MLLOG " + json.dumps(record))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def retimed(minutes: float, gbs: int | None = None, samples_scale: float = 1.0):
    """An edit: run_stop `minutes` after run_start; optionally another GBS and every samples_count scaled."""
    start = {}

    def edit(record):
        meta = record.get("metadata") or {}
        if record["key"] == "run_start":
            start["ms"] = record["time_ms"]
        if record["key"] == "run_stop":
            record["time_ms"] = start["ms"] + round(minutes * 60_000)
        if record["key"] == "global_batch_size" and gbs:
            record["value"] = gbs
        if "samples_count" in meta:
            meta["samples_count"] = round(meta["samples_count"] * samples_scale)
        return record

    return edit


def result_dir(tmp: Path, log: Path, minutes: list[float], **kw) -> Path:
    for i, m in enumerate(minutes):
        rewrite(log, tmp / f"result_{i}.txt", retimed(m, **kw))
    return tmp


def run_json(capsys, *argv) -> tuple[int, dict]:
    rc = results.main([*map(str, argv), "--json"])
    return rc, json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------- per run


def test_run_summary_matches_the_rcp_checkers_reading(runs):
    for name, status in [("run_1", "success"), ("aborted", "aborted")]:
        log = runs / name / "mllog.log"
        run = results.summarize_run(name, log)
        _, official_samples, official_gbs, _ = rcp_checker.read_submission_file(str(log), "6.0.0", False)
        assert run.status == status
        assert run.samples_to_converge == official_samples
        assert run.global_batch_size == official_gbs
        assert len(run.evals) == log.read_text().count('"key": "eval_accuracy"')
    converged = results.summarize_run("run_1", runs / "run_1" / "mllog.log")
    assert converged.samples_to_converge == converged.evals[-1][0]
    assert converged.samples_to_converge % converged.global_batch_size == 0
    assert converged.evals[-1][1] <= 0.586 < converged.evals[-2][1]


# ---------------------------------------------------------------------------------------------- score


def test_score_drops_fastest_and_slowest_of_ten(runs, tmp_path, capsys):
    rc, out = run_json(capsys, result_dir(tmp_path, runs / "run_1" / "mllog.log", MINUTES), "--out", tmp_path)
    assert rc == 0 and out["problems"] == []
    assert [r["minutes"] for r in out["runs"]] == pytest.approx(MINUTES)  # one run per result_<i>.txt, in order
    assert out["score"]["minutes"] == pytest.approx(5.5)
    assert out["score"]["averaged"] == 8
    assert "NOT" not in out["score"]["note"]


def test_a_non_converged_run_is_dropped_as_the_slowest(runs, tmp_path):
    ok = [
        results.summarize_run(f"r{i}", rewrite(runs / "run_1" / "mllog.log", tmp_path / f"r{i}.txt", retimed(m)))
        for i, m in enumerate(MINUTES[:9])
    ]
    # the aborted run is the fastest by the clock; counting it would give mean(1..8) = 4.5
    aborted = results.summarize_run(
        "fast_abort", rewrite(runs / "aborted" / "mllog.log", tmp_path / "a.txt", retimed(0.5))
    )
    score = results.mlperf_score(ok + [aborted])
    assert score.minutes == pytest.approx(5.5)
    assert "fast_abort" in score.note
    samples = results.samples_to_converge(ok + [aborted])
    converged_at = ok[0].samples_to_converge
    assert samples.not_converged == 1
    assert samples.mean == pytest.approx((9 * converged_at + 1e9) / 10)
    assert samples.olympic_mean == converged_at
    no_score = results.mlperf_score(ok[:8] + [aborted, aborted])
    assert no_score.minutes is None and "no score" in no_score.note


def three_runs(runs: Path, tmp: Path) -> list[results.Run]:
    """The real converged run, a copy of it one minute slower, and the real aborted run."""
    log = runs / "run_1" / "mllog.log"
    real = results.summarize_run("run_1", log)
    slower = results.summarize_run("slower", rewrite(log, tmp / "slower.log", retimed(real.minutes + 1)))
    return [real, slower, results.summarize_run("aborted", runs / "aborted" / "mllog.log")]


def test_fewer_than_ten_runs_say_so(runs, tmp_path):
    real, slower, aborted = three_runs(runs, tmp_path)
    score = results.mlperf_score([real, slower, aborted])
    # the aborted run is dropped as the slowest and the real run as the fastest
    assert score.minutes == pytest.approx(real.minutes + 1)
    assert score.note.startswith("NOT an MLPerf score (3 runs given, flux1 needs 10)")
    two = results.mlperf_score([real, slower])
    assert two.minutes == pytest.approx(real.minutes + 0.5)
    assert "plain mean of 2" in two.note


def test_one_run_reads_one_run(runs, capsys):
    """The README's debug run scored alone: "1 run given", "over 1 run" (it read "1 runs")."""
    assert results.main([str(runs / "run_1"), "--out", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "[NOT an MLPerf score (1 run given, flux1 needs 10); plain mean of 1" in out
    assert re.search(r"^samples to converge: mean [\d,]+ over 1 run$", out, re.M), out
    assert "NOT RUN: 1 readable run: its olympic mean needs at least 3" in out


# ---------------------------------------------------------------------------------------------- compliance


def test_compliance_passes_a_real_log_and_names_what_fails(runs, tmp_path):
    log = runs / "run_1" / "mllog.log"
    good = results.check_compliance(log)
    assert good.passed and good.messages == [] and good.failed_keys == []
    missing = rewrite(log, tmp_path / "missing.log", lambda r: None if r["key"] == "opt_adamw_beta_1" else r)
    wrong = rewrite(log, tmp_path / "wrong.log", lambda r: {**r, "value": 0.8} if r["key"] == "opt_adamw_beta_1" else r)
    for bad in (missing, wrong):
        verdict = results.check_compliance(bad)
        assert not verdict.passed
        assert verdict.failed_keys == ["opt_adamw_beta_1"]
    assert "found 0" in results.check_compliance(missing).messages[0]
    aborted = results.check_compliance(runs / "aborted" / "mllog.log")
    assert aborted.failed_keys == ["eval_accuracy"]  # no eval reached 0.586


def test_cli_exits_non_zero_naming_the_failing_and_unreadable_logs(runs, tmp_path):
    missing = rewrite(
        runs / "run_1" / "mllog.log", tmp_path / "missing.log", lambda r: None if r["key"] == "opt_adamw_beta_1" else r
    )
    garbage = tmp_path / "garbage.log"
    garbage.write_text("not an MLLOG line\n")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flux_train.outputs.results",
            str(runs / "run_1"),
            str(missing),
            str(garbage),
            str(empty),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    errors = proc.stderr.splitlines()
    assert len(errors) == 3
    assert any(str(missing) in e and "opt_adamw_beta_1" in e for e in errors)
    assert any(str(garbage) in e and "no MLLOG lines" in e for e in errors)
    assert any(str(empty) in e and "unreadable" in e for e in errors)
    assert "FAILED: opt_adamw_beta_1" in proc.stdout
    ok = subprocess.run(
        [sys.executable, "-m", "flux_train.outputs.results", str(runs / "run_1"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "passed" in ok.stdout


# ---------------------------------------------------------------------------------------------- RCP checker


def test_rcp_checker_on_debug_runs_reports_the_missing_rcp(runs, tmp_path):
    real = three_runs(runs, tmp_path)
    assert real[0].global_batch_size < 512  # below every flux1 RCP
    rcp = results.check_rcp(real)
    assert rcp.verdict == "failed"
    assert rcp.message == f"Missing RCP, please submit RCP with BS = {real[0].global_batch_size}"
    assert any("indicative" in n for n in rcp.notes) and any("512, 1024, 2048, 4096" in n for n in rcp.notes)
    assert "Run incomplete or did not converge. Marking as infinite." in rcp.notes  # the checker's own warning
    assert results.check_rcp(real[:2]).verdict == "not run"


def test_rcp_checker_at_gbs_512(runs, tmp_path):
    log = runs / "run_1" / "mllog.log"
    converged_at = results.summarize_run("run_1", log).samples_to_converge
    rcp_mean = rcp_checker.RCP_Checker("training", "6.0.0", "flux1", False)._find_rcp(512, "pruned_rcps")["RCP Mean"]
    # 7,208,960 samples: under the RCP mean (7.22 M) but within the allowed speed-up (7.11 M) -> scaled
    near = result_dir(tmp_path / "near", log, MINUTES, gbs=512, samples_scale=7_208_960 / converged_at)
    rcp = results.check_rcp([results.summarize_run(n, f) for n, f in results.find_logs([str(near)])])
    assert (rcp.verdict, rcp.message, rcp.notes) == ("passed", "RCP found", [])
    assert rcp.scaling_factor == pytest.approx(rcp_mean / 7_208_960)
    # 5,242,880 samples: faster than the reference allows
    fast = result_dir(tmp_path / "fast", log, MINUTES, gbs=512, samples_scale=5_242_880 / converged_at)
    rcp = results.check_rcp([results.summarize_run(n, f) for n, f in results.find_logs([str(fast)])])
    assert (rcp.verdict, rcp.message, rcp.scaling_factor) == ("failed", "RCP found", None)
    # GBS 1024 is pruned from the RCPs the package checker uses: judged on the 512-2048 line, not its own point
    pruned = result_dir(tmp_path / "pruned", log, MINUTES, gbs=1024, samples_scale=9_437_184 / converged_at)
    rcp = results.check_rcp([results.summarize_run(n, f) for n, f in results.find_logs([str(pruned)])])
    assert (rcp.verdict, rcp.message) == ("passed", "RCP Interpolation")


# ---------------------------------------------------------------------------------------------- plot


def test_plot_is_a_real_png(runs, tmp_path, capsys):
    rc, out = run_json(capsys, runs / "run_1", runs / "aborted", "--out", tmp_path / "plots")
    assert rc == 1  # the aborted run fails compliance
    png = Path(out["plot"])
    assert png == tmp_path / "plots" / "val_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    pixels = image.imread(png)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 500 and np.std(pixels) > 0.05


def test_a_plot_that_cannot_be_written_is_one_line(runs, tmp_path, capsys):
    """--out where no file can be made (/proc/nope), or where a folder stands in the plot's place: one line, no
    traceback, and nothing printed as if it had been written."""
    (tmp_path / "plots" / "val_loss.png").mkdir(parents=True)
    for out, code, line in [
        ("/proc/nope", 74, "fatal: --out /proc/nope/val_loss.png: writing it failed (No such file or directory); "),
        (tmp_path / "plots", 2, f"error: --out {tmp_path / 'plots' / 'val_loss.png'} is a folder; give the path of "),
    ]:
        assert results.main([str(runs / "run_1"), "--out", str(out)]) == code
        printed = capsys.readouterr()
        assert printed.err.startswith(line) and len(printed.err.splitlines()) == 1 and printed.out == "", printed.err
    assert list((tmp_path / "plots").rglob("*")) == [tmp_path / "plots" / "val_loss.png"]


def test_a_campaign_folder_is_read_run_by_run(runs, tmp_path):
    """The folder `submit --runs N` writes (one run folder each) reads as its runs, in name order."""
    campaign = tmp_path / "campaign"
    for i in range(3):
        rewrite(runs / "run_1" / "mllog.log", campaign / f"run_{i:02d}" / "mllog.log", retimed(3 + i))
    (campaign / "notes").mkdir()  # not a run: ignored
    found = results.find_logs([str(campaign)])
    assert [name for name, _ in found] == [str(campaign / f"run_{i:02d}") for i in range(3)]
    assert [round(results.summarize_run(n, log).minutes, 3) for n, log in found] == [3, 4, 5]
