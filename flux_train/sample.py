"""`python -m flux_train.sample`: the command of flux_train.tools.sample (kept where users type it)."""

from flux_train.cli import sample_parser

if __name__ == "__main__":
    sample_parser().parse_args()  # --help and a bad flag are answered here, before flux_train.tools.sample loads
    from flux_train.tools.sample import main

    raise SystemExit(main())
