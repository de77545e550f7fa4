"""`python -m flux_train.checkpoint`: the command of flux_train.tools.export (kept where users type it)."""

from flux_train.cli import answer_early, checkpoint_parser

if __name__ == "__main__":
    answer_early(checkpoint_parser())  # before flux_train.tools.export loads
    from flux_train.tools.export import main

    raise SystemExit(main())
