"""GPU dispatch for the Pallas kernels.

Path chosen (jax 0.10.x, Python 3.11): Pallas' own **Triton lowering** (`pl.pallas_call` with
`jax.experimental.pallas.triton.CompilerParams`, which selects the Triton backend instead of the default Mosaic
GPU one).  It needs no extra package and lowers from any host (tests lower to "cuda" on CPU).  jax-triton 0.4
needs jax >= 0.11 / Python >= 3.12 / triton >= 3.7, and JAX 0.11 deprecates the Pallas Triton backend in favour
of Mosaic GPU; when that backend can no longer be imported, `triton_available()` is False and the kernels'
public functions fall back to XLA here: `jax.nn.dot_product_attention` (cuDNN, local_window_size) and
`lax.ragged_dot` / `lax.ragged_dot_general`.

  attention.py       sliding-window GQA flash attention, forward + dq + dk/dv (Triton)
  grouped_matmul.py  gmm / tgmm with masked stores (Triton)
The TPU modules (pallas_kernels/sliding_window_attention.py, grouped_matmul.py) route here when
interpret is False and jax.default_backend() == "gpu"; custom_vjp wiring stays in those modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def triton_available() -> bool:
  """Whether Pallas' Triton backend can be imported (it is deprecated from JAX 0.11)."""
  try:
    from jax._src.pallas.triton import pallas_call_registration  # noqa: F401
    from jax.experimental.pallas import triton  # noqa: F401
  except ImportError:
    return False
  return True


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def check_triton_blocks(**sizes):
  """Triton tiles (and head_dim) must be powers of two >= 16 (tl.dot minimum)."""
  for name, v in sizes.items():
    if not isinstance(v, int) or v < 16 or v & (v - 1):
      raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernels, got {v!r}")


# ----------------------------------------------------------------------------------------------- XLA fallbacks
def xla_attention(q, k, v, *, window=None, segment_ids=None, scale=None):
  """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D] with jax.nn.dot_product_attention (cuDNN when possible).

  With segment_ids an explicit [B, 1, T, T] mask is built (XLA implementation), without them the causal +
  local_window_size form lets cuDNN skip masked blocks.
  """
  t = q.shape[1]
  if segment_ids is None:
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=local)
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  mask = (j <= i) if window is None else (j <= i) & (i - j < window)
  mask = mask[None, None] & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  return jax.nn.dot_product_attention(q, k, v, scale=scale, mask=mask)


def xla_gmm(lhs, rhs, group_sizes):
  """lax.ragged_dot with fp32 accumulation; rows past sum(group_sizes) are explicitly zeroed."""
  out = lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
  valid = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(valid[:, None], out, 0.0).astype(lhs.dtype)


def xla_tgmm(lhs, grad, group_sizes):
  """Per-group lhs^T @ grad via lax.ragged_dot_general (ragged contracting dimension) -> [G, K, N]."""
  dims = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
  )
  out = lax.ragged_dot_general(
    lhs, grad.astype(lhs.dtype), group_sizes.astype(jnp.int32), dims, preferred_element_type=jnp.float32
  )
  return out.astype(lhs.dtype)


def sliding_window_attention(q, k, v, **kwargs):
  """Triton attention (see attention.py); kwargs as pallas_kernels.sliding_window_attention."""
  from pallas_kernels.gpu import attention

  return attention.sliding_window_attention(q, k, v, **kwargs)


def gmm(lhs, rhs, group_sizes, *, tile_m=64, tile_k=64, tile_n=128, interpret=False):
  """Triton gmm with the custom_vjp of pallas_kernels.grouped_matmul (dlhs = gmm(dout, rhs^T), drhs = tgmm)."""
  from pallas_kernels import grouped_matmul

  check_triton_blocks(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
  return grouped_matmul.gmm_with_backend(
    lhs, rhs, group_sizes, tile_m=tile_m, tile_k=tile_k, tile_n=tile_n, interpret=interpret, backend="gpu"
  )


def tgmm(lhs, grad, group_sizes, *, tile_m=64, tile_k=64, tile_n=128, interpret=False):
  from pallas_kernels import grouped_matmul

  check_triton_blocks(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
  return grouped_matmul.tgmm_with_backend(
    lhs, grad, group_sizes, tile_m=tile_m, tile_k=tile_k, tile_n=tile_n, interpret=interpret, backend="gpu"
  )
