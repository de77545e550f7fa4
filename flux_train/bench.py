"""`python -m flux_train.bench`: the command of flux_train.tools.bench (kept where users type it)."""

from flux_train.cli import bench_parser

if __name__ == "__main__":
    bench_parser().parse_args()  # --help and a bad flag are answered here, before flux_train.tools.bench loads
    from flux_train.tools.bench import main

    raise SystemExit(main())
