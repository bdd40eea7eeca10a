"""Pure-JAX references for the Pallas kernels (naive, materialising, fp32 math).

They define the semantics the kernels must reproduce and are only meant for tests and small shapes:
  attention_reference : causal sliding-window GQA attention with segment ids (STEP35.md §1),
                        o_i = sum_j softmax_j(scale * q_i . k_j | visible(i, j)) v_j.
  gmm_reference       : out[m] = lhs[m] @ rhs[group(m)], rows past sum(group_sizes) = 0.
  tgmm_reference      : out[g] = lhs[rows of g]^T @ grad[rows of g]  ([G, K, N], 0 for empty groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def attention_mask(t: int, window: int | None, segment_ids=None):
  """Visibility mask [B or 1, T, T] (query i, key j): j <= i, i - j < window, same segment."""
  i = jnp.arange(t)[:, None]
  j = jnp.arange(t)[None, :]
  mask = j <= i
  if window is not None:
    mask = mask & (i - j < window)
  mask = mask[None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return mask


def attention_reference(q, k, v, *, window=None, segment_ids=None, scale=None, return_lse=False):
  """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> o [B, T, Hq, D] (q.dtype); optional lse [B, Hq, T] (fp32)."""
  b, t, hq, d = q.shape
  group = hq // k.shape[2]
  scale = d**-0.5 if scale is None else scale
  kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)  # the reference may materialise repeated K/V
  vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
  s = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), kf, precision=_HI) * scale
  mask = attention_mask(t, window, segment_ids)[:, None]  # [B|1, 1, T, T]
  s = jnp.where(mask, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)  # [B, Hq, T]; finite: every query sees itself
  p = jnp.exp(s - lse[..., None])
  o = jnp.einsum("bhij,bjhd->bihd", p, vf, precision=_HI).astype(q.dtype)
  return (o, lse) if return_lse else o


def _row_groups(m: int, group_sizes):
  """Group id of each of the m rows; rows past sum(group_sizes) get id G (no group)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")


def gmm_reference(lhs, rhs, group_sizes):
  """lhs [M, K], rhs [G, K, N], group_sizes [G] -> [M, N] in lhs.dtype (fp32 accumulation)."""
  m, g = lhs.shape[0], rhs.shape[0]
  onehot = jax.nn.one_hot(_row_groups(m, group_sizes), g, dtype=jnp.float32)  # [M, G]; row of zeros past sum
  out = jnp.einsum("mk,gkn,mg->mn", lhs.astype(jnp.float32), rhs.astype(jnp.float32), onehot, precision=_HI)
  return out.astype(lhs.dtype)


def tgmm_reference(lhs, grad, group_sizes):
  """lhs [M, K], grad [M, N], group_sizes [G] -> [G, K, N] in lhs.dtype (fp32 accumulation)."""
  m, g = lhs.shape[0], group_sizes.shape[0]
  onehot = jax.nn.one_hot(_row_groups(m, group_sizes), g, dtype=jnp.float32)
  out = jnp.einsum("mk,mn,mg->gkn", lhs.astype(jnp.float32), grad.astype(jnp.float32), onehot, precision=_HI)
  return out.astype(lhs.dtype)
