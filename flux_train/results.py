"""`python -m flux_train.results`: the command of flux_train.outputs.results (kept where users type it)."""

from flux_train.outputs.results import main

if __name__ == "__main__":
    raise SystemExit(main())
