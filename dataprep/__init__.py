"""Data preparation for flux-train: `python -m dataprep {convert,encode,empty-encodings,prepare,verify,fixture}`.

Every subcommand writes the energon dataset of DESIGN.md §4 (or checks it) and runs on a CPU-only host.
"""
