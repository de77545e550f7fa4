"""`python -m flux_train.plan`: the command of flux_train.tools.plan (kept where users type it)."""

from flux_train.tools.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
