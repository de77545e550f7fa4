"""`python -m flux_train.submit`: the command of flux_train.cluster.submit (kept where users type it)."""

from flux_train.cli import answer_early, submit_parser

if __name__ == "__main__":
    answer_early(submit_parser())  # before flux_train.cluster.submit loads
    from flux_train.cluster.submit import main

    raise SystemExit(main())
