"""`python -m flux_train.submit`: the command of flux_train.cluster.submit (kept where users type it)."""

from flux_train.cluster.submit import main

if __name__ == "__main__":
    raise SystemExit(main())
