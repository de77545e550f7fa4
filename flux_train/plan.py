"""`python -m flux_train.plan`: the command of flux_train.tools.plan (kept where users type it)."""

from flux_train.cli import plan_parser

if __name__ == "__main__":
    plan_parser().parse_args()  # --help and a bad flag are answered here, before flux_train.tools.plan loads
    from flux_train.tools.plan import main

    raise SystemExit(main())
