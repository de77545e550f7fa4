"""`python -m flux_train.sample`: the command of flux_train.tools.sample (kept where users type it)."""

from flux_train.cli import answer_early, sample_parser

if __name__ == "__main__":
    answer_early(sample_parser())  # before flux_train.tools.sample loads
    from flux_train.tools.sample import main

    raise SystemExit(main())
