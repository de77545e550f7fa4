"""`python -m flux_train.reduce_precision`: the command of flux_train.tools.reduce_precision (kept where users type it)."""

from flux_train.tools.reduce_precision import main

if __name__ == "__main__":
    raise SystemExit(main())
