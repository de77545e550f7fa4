"""The ddp layout's FP8 weight gradients in its buckets with the blocks compiled (Inductor on the CPU: minutes on a
cold cache); eager, and the rest of FP8 on the CPU: tests/unit/test_fp8.py."""

from tests.unit.test_fp8 import ddp_writes_fp8_weight_gradients_into_its_buckets_as_autograd_computes_them


def test_ddp_writes_fp8_weight_gradients_into_its_buckets_as_autograd_computes_them_compiled():
    """Compiled regions: within a bf16 rounding of what plain autograd sums."""
    ddp_writes_fp8_weight_gradients_into_its_buckets_as_autograd_computes_them(compiled=True)
