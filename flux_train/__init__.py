"""flux-train: pretraining Flux.1-schnell from random weights (MLPerf Training flux1)."""

__version__ = "0.1.0"
