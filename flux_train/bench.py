"""`python -m flux_train.bench`: the command of flux_train.tools.bench (kept where users type it)."""

from flux_train.cli import answer_early, bench_parser

if __name__ == "__main__":
    answer_early(bench_parser())  # before flux_train.tools.bench loads
    from flux_train.tools.bench import main

    raise SystemExit(main())
