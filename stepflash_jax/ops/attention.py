"""Causal sliding-window attention with GQA and packed-sequence segment ids (docs/kernels.md §1).

    o[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h // G]) v[b, j, h // G]

over the keys j visible from query i: j <= i, i - j < window (the window counts the current token, so Step 3.5
Flash's SWA layers use window=512) and segment_ids[b, i] == segment_ids[b, j] (pallas_kernels.masks.visible, the
one rule). G = Hq // Hkv is the GQA group. Arguments are checked by pallas_kernels.common.check_attention_args.

Implementations (``implementation=``):
  "reference"  pallas_kernels.reference.attention_reference: dense [T, T] mask, everything in fp32; O(T^2).
  "xla"        banded: queries are split into chunks of C rows and each chunk attends only to the keys of its own
               chunk and of the P = ceil((window - 1) / C) chunks before it, so the work is O(T * (window + C)).
               window None (or >= T) falls back to dense causal attention (pallas_kernels.reference.dense_attention
               on the inputs' dtype). Matmul inputs keep their dtype, accumulation, softmax and normalisation are
               fp32. Differentiable by plain autodiff.
  "pallas"     pallas_kernels.sliding_window_attention (flash kernels with a custom_vjp: Mosaic on TPU, Triton on
               GPU, interpreted on CPU; see pallas_kernels.common.kernel_target).
  None         "pallas" on TPU, "xla" elsewhere (ops.common.resolve_implementation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import check_attention_args
from pallas_kernels.masks import MASK_VALUE, visible
from pallas_kernels.reference import attention_reference as reference_attention
from pallas_kernels.reference import dense_attention
from pallas_kernels.sliding_window_attention import sliding_window_attention as pallas_attention
from stepflash_jax.ops.common import resolve_implementation


def _default_chunk_size(window: int) -> int:
  """Query chunk C of the banded path: 128, or the window rounded up to a multiple of 8 if smaller.

  Per query the band holds (P + 1) * C keys, P = ceil((window - 1) / C), i.e. between window and window + C,
  so a smaller C wastes fewer masked keys but makes more, smaller matmuls (and stacks K/V P + 1 times).
  Measured fwd+bwd on CPU at window 512 (T=4096, Hq=8, D=64): C=64 0.96x, C=128 1x, C=256 1.2x the time;
  128 also suits accelerator tiles.
  """
  return min(128, -(-window // 8) * 8)


def _band(x, n, c, p):
  """x [B, (n + p) * c, ...] (front-padded by p chunks) -> [B, n, (p + 1) * c, ...]: chunk i's band of keys.

  Row r of band i is position (i - p) * c + r of the unpadded sequence.
  """
  xs = x.reshape(x.shape[0], n + p, c, *x.shape[2:])
  return jnp.concatenate([xs[:, o : o + n] for o in range(p + 1)], axis=2)


def banded_attention(q, k, v, *, window, segment_ids=None, scale=None, chunk_size=None):
  """Chunked sliding-window attention, cost O(T * (window + C)). Shapes as in the module docstring."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  scale = d**-0.5 if scale is None else scale
  c = int(chunk_size) if chunk_size is not None else _default_chunk_size(window)
  if c <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
  c = min(c, -(-t // 8) * 8)  # no chunk longer than the (8-rounded) sequence
  n = -(-t // c)  # number of query chunks
  p = min(-(-(window - 1) // c), n - 1)  # previous key chunks that can hold visible keys
  tp = n * c
  pad_q = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
  pad_k = [(0, 0), (p * c, tp - t), (0, 0), (0, 0)]
  qc = jnp.pad(q, pad_q).reshape(b, n, c, hkv, g, d)
  # Bands gathered from fp32 copies of K and V (the same values): a key sits in up to p + 1 bands, and autodiff then
  # adds their gradients in fp32 and rounds once (as grouped_matmul.tile_matmul does for its weights)
  band = lambda x: _band(jnp.pad(x.astype(jnp.float32), pad_k), n, c, p).astype(x.dtype)
  kb, vb = band(k), band(v)  # [B, n, L, Hkv, D], L = (p + 1) * c

  # Band mask from absolute positions: query n_i * c + r, key (n_i - p) * c + l; the front padding has negative
  # positions (empty keys), the back padding keys > T - 1 are in every real query's future.
  qpos = np.arange(n)[None, :, None, None] * c + np.arange(c)[None, None, :, None]  # [1, n, C, 1]
  kpos = (np.arange(n)[None, :, None, None] - p) * c + np.arange((p + 1) * c)[None, None, None, :]  # [1, n, 1, L]
  segs = (None, None)
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    sq = jnp.pad(seg, [(0, 0), (0, tp - t)], constant_values=-1).reshape(b, n, c)
    sk = _band(jnp.pad(seg, [(0, 0), (p * c, tp - t)], constant_values=-1), n, c, p)  # [B, n, L]
    segs = (sq[:, :, :, None], sk[:, :, None, :])
  mask = jnp.asarray(visible(qpos, kpos, window, *segs, empty_keys=True))  # [B|1, n, C, L]
  mask = mask[:, :, None, :, None]  # [B|1, n, 1, C, 1, L]

  # Scores as [B, n, Hkv, C, G, L]: rows (query, group member) are contiguous in q's own layout.
  s = jnp.einsum("bnqhgd,bnkhd->bnhqgk", qc, kb, preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask, s, MASK_VALUE)
  pr = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
  denom = jnp.sum(pr, axis=-1)  # [B, n, Hkv, C, G]
  o = jnp.einsum("bnhqgk,bnkhd->bnqhgd", pr.astype(v.dtype), vb, preferred_element_type=jnp.float32)
  o = o / jnp.transpose(denom, (0, 1, 3, 2, 4))[..., None]
  return o.reshape(b, tp, hq, d)[:, :t].astype(q.dtype)


def sliding_window_attention(q, k, v, *, window, segment_ids=None, implementation=None, scale=None, chunk_size=None):
  """Causal (sliding-window) GQA attention.

  Args:
    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] with Hq % Hkv == 0.
    window: int > 0 (keys with i - j < window are visible, the current token included) or None (full causal).
    segment_ids: optional [B, T] int; queries only see keys of the same segment (packed sequences).
    implementation: "reference", "xla", "pallas" or None ("pallas" on TPU, else "xla").
    scale: score scale, default D ** -0.5.
    chunk_size: query chunk C of the "xla" banded path (default: see _default_chunk_size).
  Returns:
    o: [B, T, Hq, D] in q.dtype.
  """
  check_attention_args(q, k, v, window, segment_ids)
  implementation = resolve_implementation(implementation)
  if implementation == "reference":
    return reference_attention(q, k, v, window=window, segment_ids=segment_ids, scale=scale)
  if implementation == "pallas":
    return pallas_attention(q, k, v, window=window, segment_ids=segment_ids, scale=scale)
  if window is None or window >= q.shape[1]:  # "xla": the band covers everything, plain causal attention
    return dense_attention(q, k, v, window=None, segment_ids=segment_ids, scale=scale).astype(q.dtype)
  return banded_attention(q, k, v, window=window, segment_ids=segment_ids, scale=scale, chunk_size=chunk_size)


__all__ = ["sliding_window_attention", "reference_attention", "banded_attention"]
