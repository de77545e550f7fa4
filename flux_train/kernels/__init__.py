"""Custom kernels: the Q/K RMSNorm fused with RoPE (Triton forward/backward, torch fallback), the FP8 casts
(flux_train.kernels.fp8_cast) and AdamW over flat shards (flux_train.kernels.adamw)."""

from flux_train.kernels.rmsnorm import RMSNorm, apply_rope, rms_norm_rope, rms_norm_rope_torch, rms_norm_torch

__all__ = ["RMSNorm", "apply_rope", "rms_norm_rope", "rms_norm_rope_torch", "rms_norm_torch"]
