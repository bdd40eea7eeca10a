"""The references: plain, materialising JAX that defines what every implementation of the two ops must compute.

  attention_reference : causal sliding-window GQA attention with segment ids (docs/kernels.md §1), fp32,
                        o_i = sum_j softmax_j(scale * q_i . k_j | visible(i, j)) v_j  (pallas_kernels.masks.visible).
                        Also `stepflash_jax.ops.attention.reference_attention`. Its body, `dense_attention`, is
                        the "xla" implementation of full causal attention too.
  gmm_reference       : out[m] = lhs[m] @ rhs[group(m)], rows past sum(group_sizes) = 0, fp32.
                        Also `stepflash_jax.ops.grouped_matmul.reference_grouped_matmul`.
  tgmm_reference      : out[g] = lhs[rows of g]^T @ grad[rows of g]  ([G, K, N], 0 for empty groups), fp32.
Cost O(T^2) / O(G * M * K * N): for tests and small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.masks import MASK_VALUE, attention_mask

__all__ = ["attention_mask", "attention_reference", "dense_attention", "gmm_reference", "tgmm_reference"]

_HI = jax.lax.Precision.HIGHEST


def dense_attention(q, k, v, *, window, segment_ids=None, scale=None, precision=None):
  """[T, T]-masked attention. q [B, T, Hq, D], k/v [B, T, Hkv, D] -> fp32 [B, T, Hq, D].

  Matmul inputs keep their dtype; scores, softmax and accumulation are fp32. GQA through a [B, T, Hkv, G, D] view
  of q (K/V are never repeated).
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  scale = d**-0.5 if scale is None else scale
  qg = q.reshape(b, t, hkv, hq // hkv, d)  # query head h = kv head h // G, member h % G
  # Scores as [B, Hkv, Tq, G, Tk]: rows (query, group member) are contiguous in q's own layout.
  s = jnp.einsum("bqhgd,bkhd->bhqgk", qg, k, preferred_element_type=jnp.float32, precision=precision)
  mask = attention_mask(t, window, segment_ids)[:, None, :, None, :]  # [B|1, 1, T, 1, T]
  s = jnp.where(mask, s * scale, MASK_VALUE)
  p = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
  denom = jnp.sum(p, axis=-1)  # [B, Hkv, T, G]
  o = jnp.einsum("bhqgk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
  o = o / jnp.transpose(denom, (0, 2, 1, 3))[..., None]
  return o.reshape(b, t, hq, d)


def attention_reference(q, k, v, *, window=None, segment_ids=None, scale=None):
  """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> o [B, T, Hq, D] in q.dtype; everything fp32 at HIGHEST precision."""
  f32 = lambda x: x.astype(jnp.float32)
  o = dense_attention(f32(q), f32(k), f32(v), window=window, segment_ids=segment_ids, scale=scale, precision=_HI)
  return o.astype(q.dtype)


def _row_groups(m: int, group_sizes):
  """Group id of each of the m rows; rows past sum(group_sizes) get id G (no group)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")


def gmm_reference(lhs, rhs, group_sizes):
  """lhs [M, K], rhs [G, K, N], group_sizes [G] -> [M, N] in lhs.dtype: one masked fp32 matmul per group.

  Rows past sum(group_sizes) are exactly 0 whatever they hold (e.g. NaN padding).
  """
  rows = _row_groups(lhs.shape[0], group_sizes)
  out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
  for g in range(rhs.shape[0]):
    x = jnp.where((rows == g)[:, None], lhs.astype(jnp.float32), 0.0)
    out = out + jnp.dot(x, rhs[g].astype(jnp.float32), precision=_HI)
  return out.astype(lhs.dtype)


def tgmm_reference(lhs, grad, group_sizes):
  """lhs [M, K], grad [M, N], group_sizes [G] -> [G, K, N] in lhs.dtype (fp32 accumulation)."""
  m, g = lhs.shape[0], group_sizes.shape[0]
  onehot = jax.nn.one_hot(_row_groups(m, group_sizes), g, dtype=jnp.float32)
  out = jnp.einsum("mk,mn,mg->gkn", lhs.astype(jnp.float32), grad.astype(jnp.float32), onehot, precision=_HI)
  return out.astype(lhs.dtype)
