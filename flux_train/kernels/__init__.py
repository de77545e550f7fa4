"""Custom kernels: RMSNorm (Triton forward/backward, torch fallback)."""

from flux_train.kernels.rmsnorm import RMSNorm, default_eps, rms_norm, rms_norm_torch

__all__ = ["RMSNorm", "default_eps", "rms_norm", "rms_norm_torch"]
