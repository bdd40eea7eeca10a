"""What the Pallas kernels share: dot dimensions, padding, block/visit lists, where the kernels run, argument checks.

Imported by the TPU kernels (pallas_kernels/tpu/), the GPU kernels (pallas_kernels/gpu/), the public entries
(sliding_window_attention.py, grouped_matmul.py) and `stepflash_jax.ops`, whose argument checks are the ones
below (one check per op). It imports nothing of the project.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # Pallas' Triton backend is deprecated from JAX 0.11 and may be missing: then the GPU entries fall back to XLA
  from jax.experimental.pallas import triton as plgpu
except ImportError:
  plgpu = None

NN = (((1,), (0,)), ((), ()))  # a @ b
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def dot(a, b, dims):
  """fp32-accumulating dot_general; fp32 inputs use full fp32 precision (not bf16/TF32 passes)."""
  exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(
    a, b, dims, precision=lax.Precision.HIGHEST if exact else None, preferred_element_type=jnp.float32
  )


def round_up(x, m):
  return -(-x // m) * m


def pad_to(x, shape, value=0):
  """Pad x at the end of every axis up to `shape`."""
  return jnp.pad(x, [(0, s - n) for n, s in zip(x.shape, shape)], constant_values=value)


def pad_axis(x, axis, size, value=0):
  """Pad x at the end of one axis up to `size`."""
  return pad_to(x, x.shape[:axis] + (size,) + x.shape[axis + 1 :], value)


# ----------------------------------------------------------------------------------------------- where kernels run
@functools.cache
def triton_available() -> bool:
  """Whether Pallas' Triton backend can be imported (it is deprecated from JAX 0.11)."""
  if plgpu is None:
    return False
  try:  # a probe: JAX itself imports this module lazily, when it lowers a Triton pallas_call
    from jax._src.pallas.triton import pallas_call_registration  # noqa: F401
  except ImportError:
    return False
  return True


def kernel_target(interpret=None) -> str:
  """Where the Pallas entries run; the only place in pallas_kernels that reads jax.default_backend().

  "interpret": the TPU kernels in Pallas' interpreter (interpret=True, or None on a CPU backend); "tpu": Mosaic;
  "gpu": the Triton kernels of pallas_kernels.gpu; "xla": a GPU whose JAX lacks Pallas' Triton backend, where the
  entries fall back to XLA (pallas_kernels.gpu.xla_*).
  """
  platform = jax.default_backend()
  if interpret or (interpret is None and platform == "cpu"):
    return "interpret"
  if platform == "gpu":
    return "gpu" if triton_available() else "xla"
  return "tpu"


# ----------------------------------------------------------------------------------------------- attention blocks
def padded_seq_len(seq_len, block_q, block_k):
  """T padded to a multiple of lcm(block_q, block_k): padded keys are only visible to padded queries."""
  return round_up(seq_len, math.lcm(block_q, block_k))


def kv_block_range(q_block, *, seq_len, window, block_q, block_k, maximum=max, minimum=min, div=operator.floordiv):
  """Inclusive (first, last) key block that query block `q_block` can see.

  Works on python ints and (with maximum=jnp.maximum, minimum=jnp.minimum, div=lax.div) on traced int32.
  Last: the block of the last *real* query (causal). First: the block of its first query's oldest key.
  """
  q_first = q_block * block_q
  q_last = minimum(q_first + block_q, seq_len) - 1
  first = 0 if window is None else div(maximum(q_first - window + 1, 0), block_k)
  return first, div(q_last, block_k)


def q_block_range(k_block, *, seq_len, window, block_q, block_k, maximum=max, minimum=min, div=operator.floordiv):
  """Inclusive (first, last) query block that sees key block `k_block`: the exact transpose of kv_block_range."""
  del maximum
  n_q = -(-seq_len // block_q)
  first = div(k_block * block_k, block_q)
  if window is None:
    return first, n_q - 1
  return first, minimum(div(k_block * block_k + block_k + window - 2, block_q), n_q - 1)


def visited_blocks(seq_len: int, window: int | None, block_q: int, block_k: int) -> list[tuple[int, int]]:
  """(q_block, k_block) pairs the kernels compute, q-major; the exact list fed to the TPU kernels' grid."""
  pairs = []
  for qi in range(-(-seq_len // block_q)):
    lo, hi = kv_block_range(qi, seq_len=seq_len, window=window, block_q=block_q, block_k=block_k)
    pairs.extend((qi, kj) for kj in range(lo, hi + 1))
  return pairs


def num_visited_blocks(seq_len: int, window: int | None, block_q: int = 128, block_k: int = 128) -> int:
  return len(visited_blocks(seq_len, window, block_q, block_k))


# ----------------------------------------------------------------------------------------------- gmm visits
def group_metadata(group_sizes, m_pad: int, tm: int, *, with_tail: bool, visit_empty: bool):
  """Visit lists for the grid. Returns (visit_group [V], visit_tile [V], starts [G'], ends [G'], n_visits [1], V).

  G' = G + 1 with the tail group (rows past the sum, up to m_pad), else G. V = m_tiles + G' - 1 (static bound).
  """
  m_tiles = m_pad // tm
  sizes = group_sizes.astype(jnp.int32)
  if with_tail:
    sizes = jnp.concatenate([sizes, jnp.maximum(m_pad - jnp.sum(sizes), 0)[None]])
  ends = jnp.minimum(jnp.cumsum(sizes), m_pad)  # a sum > m_pad (contract violation) is clipped
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  first_tile = jnp.minimum(starts // tm, m_tiles - 1)
  spanned = jnp.where(ends > starts, (ends - 1) // tm - starts // tm + 1, 1 if visit_empty else 0)
  visit_end = jnp.cumsum(spanned)
  n_visits = visit_end[-1]
  n_bound = m_tiles + sizes.shape[0] - 1
  t = jnp.minimum(jnp.arange(n_bound, dtype=jnp.int32), n_visits - 1)  # dead visits repeat the last one
  group = jnp.searchsorted(visit_end, t, side="right").astype(jnp.int32)
  tile = first_tile[group] + t - (visit_end - spanned)[group]
  return group, tile.astype(jnp.int32), starts, ends, n_visits[None].astype(jnp.int32), n_bound


# ----------------------------------------------------------------------------------------------- argument checks
def _positive_int(v):
  return not isinstance(v, bool) and isinstance(v, (int, np.integer)) and v >= 1


def check_positive_ints(**sizes):
  for name, v in sizes.items():
    if not _positive_int(v):
      raise ValueError(f"{name} must be a positive int, got {v!r}")


def check_attention_args(q, k, v, window, segment_ids, **blocks):
  """Sliding-window attention arguments (ops.sliding_window_attention and the Pallas entries).

  q, k, v share one float dtype (f32 / bf16 / f16); the kernels also pass their block sizes (positive ints).
  """
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
  if k.ndim != 4:
    raise ValueError(f"k must be [B, T, Hkv, D], got shape {k.shape}")
  if v.shape != k.shape:
    raise ValueError(f"v must have the shape of k {k.shape}, got shape {v.shape}")
  b, t, hq, d = q.shape
  if (k.shape[0], k.shape[1], k.shape[3]) != (b, t, d):
    raise ValueError(f"k shape {k.shape} does not match q shape {q.shape} in B, T or D")
  if k.shape[2] == 0 or hq % k.shape[2]:
    raise ValueError(f"query heads must be a multiple of kv heads: q shape {q.shape}, k shape {k.shape}")
  if window is not None and not _positive_int(window):
    raise ValueError(f"window must be a positive int or None, got {window!r}")
  if segment_ids is not None and tuple(segment_ids.shape) != (b, t):
    raise ValueError(f"segment_ids must be [B, T] = {(b, t)}, got shape {tuple(segment_ids.shape)}")
  if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise ValueError(f"q, k, v must share one float dtype (f32/bf16/f16), got {q.dtype}, {k.dtype}, {v.dtype}")
  if blocks:
    check_positive_ints(**blocks)


def check_group_sizes(group_sizes, n_groups=None):
  """group_sizes must be an int vector, of length n_groups when given."""
  shape_ok = group_sizes.ndim == 1 and (n_groups is None or group_sizes.shape[0] == n_groups)
  if not shape_ok or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    g = "G" if n_groups is None else f"G={n_groups}"
    raise ValueError(f"group_sizes must be an int array [{g}], got {group_sizes.dtype} shape {group_sizes.shape}")


def check_gmm_args(lhs, rhs, group_sizes, **tiles):
  """Grouped matmul arguments (ops.grouped_matmul and the Pallas gmm entries; the kernels also pass their tiles)."""
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"rhs must be [G, K, N], got shape {rhs.shape}")
  if rhs.shape[1] != lhs.shape[1]:
    raise ValueError(f"rhs [G, K, N] {rhs.shape} must share K with lhs [M, K] {lhs.shape}")
  check_group_sizes(group_sizes, rhs.shape[0])
  check_positive_ints(**tiles)


def check_tgmm_args(lhs, grad, group_sizes, **tiles):
  """Transposed grouped matmul (weight gradient) arguments of the Pallas tgmm entries."""
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
  if grad.ndim != 2:
    raise ValueError(f"grad must be [M, N], got shape {grad.shape}")
  if grad.shape[0] != lhs.shape[0]:
    raise ValueError(f"grad [M, N] {grad.shape} must share M with lhs [M, K] {lhs.shape}")
  check_group_sizes(group_sizes)
  check_positive_ints(**tiles)
