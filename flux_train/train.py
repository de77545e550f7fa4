"""`python -m flux_train.train`: the command of flux_train.training.train (kept where users type it)."""

from flux_train.cli import train_parser

if __name__ == "__main__":
    train_parser().parse_args()  # --help and a bad flag are answered here, before flux_train.training.train loads
    from flux_train.training.train import main

    raise SystemExit(main())
