"""`python -m flux_train.checkpoint`: the command of flux_train.training.checkpoint (kept where users type it)."""

from flux_train.training.checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
