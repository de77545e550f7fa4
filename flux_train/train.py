"""`python -m flux_train.train`: the command of flux_train.training.train (kept where users type it)."""

from flux_train.training.train import main

if __name__ == "__main__":
    raise SystemExit(main())
