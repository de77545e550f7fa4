"""`python -m flux_train.results`: the command of flux_train.outputs.results (kept where users type it)."""

from flux_train.cli import results_parser

if __name__ == "__main__":
    results_parser().parse_args()  # --help and a bad flag are answered here, before flux_train.outputs.results loads
    from flux_train.outputs.results import main

    raise SystemExit(main())
