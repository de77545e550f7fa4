"""The command lines explain themselves: `--help` of every command and subcommand gives every flag a line of help;
`python -m flux_train.train --print-config` prints the resolved config."""
import argparse

import pytest
import yaml

from dataprep.__main__ import main as dataprep
from flux_train import bench, checkpoint, results, sample, submit, train

COMMANDS = {"python -m dataprep": dataprep, "python -m flux_train.train": train.main,
            "python -m flux_train.submit": submit.main, "python -m flux_train.bench": bench.main,
            "python -m flux_train.results": results.main, "python -m flux_train.checkpoint": checkpoint.main,
            "python -m flux_train.sample": sample.main}


def printed_help(main, argv, monkeypatch, capsys) -> argparse.ArgumentParser:
    """Runs `main(argv + ["--help"])` for real and returns the parser whose help it printed."""
    shown = []
    real = argparse.ArgumentParser.print_help

    def spy(self, file=None):
        shown.append(self)
        real(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", spy)
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
    return shown[-1]


def undocumented(main, argv, monkeypatch, capsys) -> list[str]:
    """Flags, positionals and subcommands without help, in this (sub)command and every subcommand below it."""
    parser = printed_help(main, argv, monkeypatch, capsys)
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            described = {a.dest for a in action._choices_actions if a.help and a.help.strip()}
            for name in action.choices:
                missing += [] if name in described else [" ".join([*argv, name]) + " (subcommand)"]
                missing += undocumented(main, [*argv, name], monkeypatch, capsys)
        elif not (action.help and action.help.strip()) or action.help == argparse.SUPPRESS:
            missing.append(" ".join([*argv, action.option_strings[0] if action.option_strings else action.dest]))
    return missing


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_every_subcommand_has_help(command, monkeypatch, capsys):
    assert undocumented(COMMANDS[command], [], monkeypatch, capsys) == []


def test_the_help_walk_finds_a_flag_without_help(monkeypatch, capsys):
    def tool(argv):
        p = argparse.ArgumentParser(prog="tool")
        sub = p.add_subparsers(dest="cmd")
        run = sub.add_parser("run", help="runs")
        run.add_argument("--fast", help="faster")
        run.add_argument("--quiet", action="store_true")
        sub.add_parser("stop")
        p.parse_args(argv)

    assert undocumented(tool, [], monkeypatch, capsys) == ["run --quiet", "stop (subcommand)"]


def test_print_config_shows_defaults_and_overrides_resolved(capsys):
    assert train.main(["--config", "configs/debug.yaml", "--set", "train.lr=0.5", "--set", "eval.batch_size=4",
                       "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["lr"] == 0.5 and printed["eval"]["batch_size"] == 4  # --set
    assert printed["train"]["global_batch_size"] == 8  # the file itself
    assert printed["model"]["flavor"] == "flux-debug" and printed["model"]["num_layers"] == 2  # its defaults:
    assert printed["logging"]["mllog_stdout"] is False  # and the built-in defaults
