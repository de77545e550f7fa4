"""`python -m flux_train.submit`: the command of flux_train.cluster.submit (kept where users type it)."""

from flux_train.cli import submit_parser

if __name__ == "__main__":
    submit_parser().parse_args()  # --help and a bad flag are answered here, before flux_train.cluster.submit loads
    from flux_train.cluster.submit import main

    raise SystemExit(main())
