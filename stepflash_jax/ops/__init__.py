"""Pure-JAX ops with "reference" / "xla" / "pallas" implementations (see notes in each module)."""

from stepflash_jax.ops.attention import sliding_window_attention
from stepflash_jax.ops.grouped_matmul import grouped_matmul

__all__ = ["sliding_window_attention", "grouped_matmul"]
