"""Causal sliding-window attention with GQA and packed-sequence segment ids (STEP35.md §1).

    o[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h // G]) v[b, j, h // G]

over the keys j visible from query i: j <= i, i - j < window (the window counts the current token, so Step 3.5
Flash's SWA layers use window=512) and segment_ids[b, i] == segment_ids[b, j]. G = Hq // Hkv is the GQA group.

Implementations (``implementation=``):
  "reference"  dense [T, T] mask, everything in fp32. Simple and obviously right; O(T^2).
  "xla"        banded: queries are split into chunks of C rows and each chunk attends only to the keys of its own
               chunk and of the P = ceil((window - 1) / C) chunks before it, so the work is O(T * (window + C)).
               window None (or >= T) falls back to dense causal attention. Matmul inputs keep their dtype,
               accumulation, softmax and normalisation are fp32. Differentiable by plain autodiff.
  "pallas"     pallas_kernels.sliding_window_attention (flash-style kernel with its own custom_vjp).
  None         "pallas" on TPU, "xla" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30  # finite "minus infinity": a masked score; every real query sees itself, so no row is all-masked.


def _default_chunk_size(window: int) -> int:
  """Query chunk C of the banded path: 128, or the window rounded up to a multiple of 8 if smaller.

  Per query the band holds (P + 1) * C keys, P = ceil((window - 1) / C), i.e. between window and window + C,
  so a smaller C wastes fewer masked keys but makes more, smaller matmuls (and stacks K/V P + 1 times).
  Measured fwd+bwd on CPU at window 512 (T=4096, Hq=8, D=64): C=64 0.96x, C=128 1x, C=256 1.2x the time;
  128 also suits accelerator tiles.
  """
  return min(128, -(-window // 8) * 8)


def _validate(q, k, v, window, segment_ids):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
  if k.ndim != 4:
    raise ValueError(f"k must be [B, T, Hkv, D], got shape {k.shape}")
  if v.shape != k.shape:
    raise ValueError(f"v must have the shape of k {k.shape}, got shape {v.shape}")
  b, t, hq, d = q.shape
  if k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
    raise ValueError(f"k shape {k.shape} does not match q shape {q.shape} in B, T or D")
  if k.shape[2] == 0 or hq % k.shape[2] != 0:
    raise ValueError(f"q heads must be a multiple of k heads: q shape {q.shape}, k shape {k.shape}")
  if window is not None:
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window <= 0:
      raise ValueError(f"window must be a positive int or None, got {window!r}")
  if segment_ids is not None and tuple(segment_ids.shape) != (b, t):
    raise ValueError(f"segment_ids must be [B, T] = {(b, t)}, got shape {tuple(segment_ids.shape)}")


def _dense(q, k, v, window, segment_ids, scale, precision=None):
  """Dense masked attention. q [B, T, Hq, D], k/v [B, T, Hkv, D] -> fp32 [B, T, Hq, D]."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d)  # query head h = kv head h // G, member h % G
  # Scores as [B, Hkv, Tq, G, Tk]: rows (query, group member) are contiguous in q's own layout.
  s = jnp.einsum("bqhgd,bkhd->bhqgk", qg, k, preferred_element_type=jnp.float32, precision=precision)
  s = s * scale
  i = np.arange(t)[:, None]
  j = np.arange(t)[None, :]
  allowed = j <= i
  if window is not None:
    allowed = allowed & (i - j < window)
  mask = jnp.asarray(allowed)[None]  # [1, T, T]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  mask = mask[:, None, :, None, :]  # [B, 1, T, 1, T]
  s = jnp.where(mask, s, _NEG)
  p = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
  denom = jnp.sum(p, axis=-1)  # [B, Hkv, T, G]
  o = jnp.einsum("bhqgk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
  o = o / jnp.transpose(denom, (0, 2, 1, 3))[..., None]
  return o.reshape(b, t, hq, d)


def reference_attention(q, k, v, *, window, segment_ids=None, scale=None):
  """Dense [T, T]-masked attention in fp32 (GQA via a [B, T, Hkv, G, D] view of q, no K/V repeat)."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  f32 = lambda x: x.astype(jnp.float32)
  o = _dense(f32(q), f32(k), f32(v), window, segment_ids, scale, precision=jax.lax.Precision.HIGHEST)
  return o.astype(q.dtype)


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
  kb = _band(jnp.pad(k, pad_k), n, c, p)  # [B, n, L, Hkv, D], L = (p + 1) * c
  vb = _band(jnp.pad(v, pad_k), n, c, p)

  # Static band mask from absolute positions: query n_i * c + r, key (n_i - p) * c + l.
  qpos = np.arange(n)[:, None, None] * c + np.arange(c)[None, :, None]
  kpos = (np.arange(n)[:, None, None] - p) * c + np.arange((p + 1) * c)[None, None, :]
  allowed = (kpos >= 0) & (kpos <= qpos) & (qpos - kpos < window)  # [n, C, L]; pad keys > T-1 > real q
  mask = jnp.asarray(allowed)[None]
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    sq = jnp.pad(seg, [(0, 0), (0, tp - t)], constant_values=-1).reshape(b, n, c)
    sk = _band(jnp.pad(seg, [(0, 0), (p * c, tp - t)], constant_values=-1), n, c, p)  # [B, n, L]
    mask = mask & (sq[:, :, :, None] == sk[:, :, None, :])
  mask = mask[:, :, None, :, None]  # [B, n, 1, C, 1, L]

  # Scores as [B, n, Hkv, C, G, L]: rows (query, group member) are contiguous in q's own layout.
  s = jnp.einsum("bnqhgd,bnkhd->bnhqgk", qc, kb, preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask, s, _NEG)
  pr = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
  denom = jnp.sum(pr, axis=-1)  # [B, n, Hkv, C, G]
  o = jnp.einsum("bnhqgk,bnkhd->bnqhgd", pr.astype(v.dtype), vb, preferred_element_type=jnp.float32)
  o = o / jnp.transpose(denom, (0, 1, 3, 2, 4))[..., None]
  return o.reshape(b, tp, hq, d)[:, :t].astype(q.dtype)


def _pallas(q, k, v, *, window, segment_ids, scale):
  try:
    from pallas_kernels.sliding_window_attention import sliding_window_attention as kernel
  except ImportError as e:  # the kernel is another contributor's module
    raise ImportError(
      "implementation='pallas' needs pallas_kernels.sliding_window_attention."
      f"sliding_window_attention, which could not be imported: {e}"
    ) from e
  return kernel(q, k, v, window=window, segment_ids=segment_ids, scale=scale)


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
  _validate(q, k, v, window, segment_ids)
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "tpu" else "xla"
  t = q.shape[1]
  if implementation == "reference":
    return reference_attention(q, k, v, window=window, segment_ids=segment_ids, scale=scale)
  if implementation == "xla":
    if window is None or window >= t:  # the band covers everything: plain causal attention
      scale = q.shape[-1] ** -0.5 if scale is None else scale
      return _dense(q, k, v, None, segment_ids, scale).astype(q.dtype)
    return banded_attention(q, k, v, window=window, segment_ids=segment_ids, scale=scale, chunk_size=chunk_size)
  if implementation == "pallas":
    return _pallas(q, k, v, window=window, segment_ids=segment_ids, scale=scale)
  raise ValueError(f"implementation must be 'reference', 'xla', 'pallas' or None, got {implementation!r}")


__all__ = ["sliding_window_attention", "reference_attention", "banded_attention"]
