"""`python -m flux_train.reduce_precision`: the command of flux_train.tools.reduce_precision (kept where users type it)."""

from flux_train.cli import answer_early, reduce_precision_parser

if __name__ == "__main__":
    answer_early(reduce_precision_parser())  # before flux_train.tools.reduce_precision loads
    from flux_train.tools.reduce_precision import main

    raise SystemExit(main())
