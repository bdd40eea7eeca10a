"""Pure-JAX ops with "reference" / "xla" / "pallas" (or "chunked") implementations (see notes in each module)."""

from stepflash_jax.ops.attention import sliding_window_attention
from stepflash_jax.ops.grouped_matmul import grouped_matmul
from stepflash_jax.ops.logprobs import token_logprobs

__all__ = ["sliding_window_attention", "grouped_matmul", "token_logprobs"]
