"""The one attention visibility rule and the one masked-score value, for every attention in the project.

    key j is visible from query i  iff  j <= i,  i - j < window (None: no limit),  segment(i) == segment(j)

(docs/kernels.md §1). The Pallas kernels (TPU and GPU), the references, `stepflash_jax.ops` (banded "xla" path) and
the model's cached attention all build their masks with `visible`; this module imports nothing of the project.
"""

from __future__ import annotations

import jax.numpy as jnp

MASK_VALUE = -1e30  # a masked score: finite, so exp(MASK_VALUE - MASK_VALUE) never yields NaN


def visible(q_pos, k_pos, window, q_seg=None, k_seg=None, *, empty_keys=False):
  """Boolean visibility of key position k_pos from query position q_pos (broadcastable int arrays, NumPy or JAX).

  window: int or None. q_seg/k_seg: segment ids broadcastable like the positions, or None (one segment).
  empty_keys=True also hides keys at negative positions (empty KV-cache slots, front padding); the kernels never
  have such keys and leave the test out.
  """
  mask = k_pos <= q_pos
  if window is not None:
    mask = mask & (q_pos - k_pos < window)
  if q_seg is not None:
    mask = mask & (q_seg == k_seg)
  if empty_keys:
    mask = mask & (k_pos >= 0)
  return mask


def attention_mask(t: int, window: int | None, segment_ids=None):
  """Dense visibility [B or 1, T, T] (query i, key j) of positions 0..t-1; segment_ids [B, T] or None."""
  pos = jnp.arange(t)
  segs = (None, None) if segment_ids is None else (segment_ids[:, :, None], segment_ids[:, None, :])
  return visible(pos[None, :, None], pos[None, None, :], window, *segs)
