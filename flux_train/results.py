"""`python -m flux_train.results`: the command of flux_train.outputs.results (kept where users type it)."""

from flux_train.cli import answer_early, results_parser

if __name__ == "__main__":
    answer_early(results_parser())  # before flux_train.outputs.results loads
    from flux_train.outputs.results import main

    raise SystemExit(main())
