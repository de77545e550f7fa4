"""`python -m flux_train.bench`: the command of flux_train.tools.bench (kept where users type it)."""

from flux_train.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
