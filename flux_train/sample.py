"""`python -m flux_train.sample`: the command of flux_train.training.sample (kept where users type it)."""

from flux_train.training.sample import main

if __name__ == "__main__":
    raise SystemExit(main())
