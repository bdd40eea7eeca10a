"""GPU side of the Pallas kernels: the Triton kernels, entries that force them, and the XLA fallbacks.

Path chosen (jax 0.10.x, Python 3.11): Pallas' own **Triton lowering** (`pl.pallas_call` with
`jax.experimental.pallas.triton.CompilerParams`, which selects the Triton backend instead of the default Mosaic
GPU one).  It needs no extra package and lowers from any host (tests lower to "cuda" on CPU).  jax-triton 0.4
needs jax >= 0.11 / Python >= 3.12 / triton >= 3.7, and JAX 0.11 deprecates the Pallas Triton backend in favour
of Mosaic GPU; when that backend can no longer be imported, `triton_available()` is False and the public entries
fall back to XLA here: `jax.nn.dot_product_attention` (cuDNN, local_window_size) and
`lax.ragged_dot` / `lax.ragged_dot_general`.

  attention.py       sliding-window GQA flash attention, forward + dq + dk/dv (Triton)
  grouped_matmul.py  gmm / tgmm with masked stores (Triton)
The public entries (pallas_kernels/sliding_window_attention.py, grouped_matmul.py) call the entries below when
`common.kernel_target` says "gpu"; both go through the custom_vjp wiring of pallas_kernels.vjp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import vjp
from pallas_kernels.common import check_attention_args, check_gmm_args, check_tgmm_args, triton_available
from pallas_kernels.gpu import attention as triton_attention
from pallas_kernels.gpu import grouped_matmul as triton_gmm
from pallas_kernels.masks import attention_mask

__all__ = [
  "check_triton_blocks",
  "gmm",
  "has_gpu",
  "sliding_window_attention",
  "tgmm",
  "triton_available",
  "xla_attention",
  "xla_gmm",
  "xla_tgmm",
]


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


# ----------------------------------------------------------------------------------------------- Triton entries
def sliding_window_attention(
  q, k, v, *, window=None, segment_ids=None, scale=None, block_q=64, block_k=64, interpret=False
):
  """The Triton attention kernels (interpret=True runs them on CPU); arguments as pallas_kernels'."""
  check_attention_args(q, k, v, window, segment_ids, block_q=block_q, block_k=block_k)
  check_triton_blocks(block_q=block_q, block_k=block_k, head_dim=q.shape[-1])
  return vjp.attention(
    triton_attention,
    q,
    k,
    v,
    window=window,
    segment_ids=segment_ids,
    scale=scale,
    block_q=block_q,
    block_k=block_k,
    interpret=interpret,
  )


def gmm(lhs, rhs, group_sizes, *, tile_m=64, tile_k=64, tile_n=128, interpret=False):
  """Triton gmm, differentiable through pallas_kernels.vjp (dlhs = gmm(dout, rhs^T), drhs = tgmm)."""
  tiles = dict(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
  check_gmm_args(lhs, rhs, group_sizes, **tiles)
  check_triton_blocks(**tiles)
  return vjp.gmm(triton_gmm, lhs, rhs, group_sizes, **tiles, interpret=interpret)


def tgmm(lhs, grad, group_sizes, *, tile_m=64, tile_k=64, tile_n=128, interpret=False):
  tiles = dict(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
  check_tgmm_args(lhs, grad, group_sizes, **tiles)
  check_triton_blocks(**tiles)
  return vjp.tgmm(triton_gmm, lhs, grad, group_sizes, **tiles, interpret=interpret)


# ----------------------------------------------------------------------------------------------- XLA fallbacks
def xla_attention(q, k, v, *, window=None, segment_ids=None, scale=None):
  """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D] with jax.nn.dot_product_attention (cuDNN when possible).

  With segment_ids an explicit [B, 1, T, T] mask is built (XLA implementation), without them the causal +
  local_window_size form lets cuDNN skip masked blocks.
  """
  if segment_ids is None:
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=local)
  mask = attention_mask(q.shape[1], window, segment_ids)[:, None]
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
