"""Data preparation for flux-train: `python -m dataprep {convert,encode,empty-encodings,prepare,verify,fixture}`.

Every subcommand writes the energon dataset (its format: dataprep/format.py, docs/data-format.md) or checks it,
and runs on a CPU-only host.
"""
