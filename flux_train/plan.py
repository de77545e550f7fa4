"""`python -m flux_train.plan`: the command of flux_train.tools.plan (kept where users type it)."""

from flux_train.cli import answer_early, plan_parser

if __name__ == "__main__":
    answer_early(plan_parser())  # before flux_train.tools.plan loads
    from flux_train.tools.plan import main

    raise SystemExit(main())
