"""Context (sequence) parallelism for attention: per-device bodies, run inside local_ops' shard_map
(docs/sharding.md §5).

Device s of the context axis (n devices) holds positions s * Tl .. (s + 1) * Tl - 1 of its sequences (T = n * Tl)
of q [b, Tl, Hq, D], k / v [b, Tl, Hkv, D] and the segment ids [b, Tl]. RoPE was applied before, from the global
positions, so the attention here needs only the visibility rule of pallas_kernels.masks (causal by index, window,
equal segment ids).

  Sliding-window layers (window W < T): `halo_attention`. A query sees at most W - 1 earlier keys, so each device
      receives the last W - 1 keys / values / segment ids of the shards before it (`lax.ppermute`, one hop when
      Tl >= W - 1) and runs the ordinary kernel on [halo; own keys] with W - 1 leading dummy queries whose outputs
      are dropped. Bytes sent per layer: 2 (K, V) * (W - 1) * b * Hkv * D * itemsize + the ids: proportional to W
      and independent of T. Backward sends the halo's K / V gradients back the same way (ppermute's transpose).
  Full-attention layers: `ring_attention` (context_full="ring"): K / V blocks travel n - 1 steps around the ring;
      each device merges the blocks with the online softmax (running max m, sum l, output acc, fp32); blocks from
      later shards are entirely in the future and skipped (lax.cond). Or `gathered_attention`
      (context_full="all_gather"): all K / V gathered, one masked block. Both send (n - 1) * Tl keys and values per
      device per layer; the ring never holds more than two blocks. Their block math is XLA's (dense per block pair,
      fp32 scores): the Pallas kernel has no query offset or log-sum-exp output to merge with.

Known limit: the causal ring is unbalanced (shard s computes s + 1 blocks); a zig-zag layout would even it out.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.masks import MASK_VALUE

FULL_MODES = ("ring", "all_gather")


def halo(x, axis, n: int, size: int):
  """The `size` positions before this shard: x [b, Tl, ...] -> [b, size, ...], zeros before position 0.

  Hop h (1 <= h <= min(ceil(size / Tl), n - 1)) brings the last min(Tl, size - (h - 1) Tl) positions of shard
  me - h (`lax.ppermute`): only what the window can see travels, one hop when Tl >= size."""
  tl = x.shape[1]
  hops = min(-(-size // tl), n - 1)
  parts = []
  for h in range(hops, 0, -1):
    take = min(tl, size - (h - 1) * tl)
    parts.append(lax.ppermute(x[:, tl - take :], axis, [(i, i + h) for i in range(n - h)]))
  got = jnp.concatenate(parts, 1) if parts else x[:, :0]
  if got.shape[1] < size:  # the window reaches before position 0 on every shard
    got = jnp.pad(got, [(0, 0), (size - got.shape[1], 0)] + [(0, 0)] * (x.ndim - 2))
  return got


def halo_attention(q, k, v, seg, *, axis, n: int, window: int, attend):
  """Sliding-window attention of this shard's queries. attend(q, k, v, segment_ids) is ops.sliding_window_attention
  with the window bound; seg [b, Tl] int (>= 0). Returns [b, Tl, Hq, D]."""
  w = window - 1
  if w == 0:
    return attend(q, k, v, seg)
  s = seg.astype(jnp.int32) + 1  # >= 1 on real keys; the halo's zeros (before position 0) become -1: never visible
  hs = halo(s, axis, n, w)
  seg2 = jnp.concatenate([jnp.where(hs == 0, -1, hs), s], 1)
  kv = [jnp.concatenate([halo(x, axis, n, w), x], 1) for x in (k, v)]
  q2 = jnp.pad(q, [(0, 0), (w, 0), (0, 0), (0, 0)])  # w dummy queries, dropped below
  return attend(q2, *kv, seg2)[:, w:]


def _block(qg, k, v, qseg, kseg, scale, q0=None):
  """Softmax statistics of queries qg [b, Tq, Hkv, G, D] over one key block k / v [b, Tk, Hkv, D]:
  (m, l [b, Tq, Hkv, G], acc [b, Tq, Hkv, G, D]), all fp32, with m = max_j s_j (no gradient), l = sum_j exp(s_j - m),
  acc = sum_j exp(s_j - m) v_j over the visible keys: equal segment ids and, if q0 (the position of the first query
  in the block's key positions) is given, j <= q0 + i."""
  s = jnp.einsum("bqhgd,bkhd->bqhgk", qg, k, preferred_element_type=jnp.float32) * scale
  mask = qseg[:, :, None, None, None] == kseg[:, None, None, None, :]
  if q0 is not None:
    causal = jnp.arange(k.shape[1])[None, :] <= (q0 + jnp.arange(qg.shape[1]))[:, None]
    mask = mask & causal[None, :, None, None]
  s = jnp.where(mask, s, MASK_VALUE)
  m = lax.stop_gradient(jnp.max(s, axis=-1))
  p = jnp.exp(s - m[..., None])
  acc = jnp.einsum("bqhgk,bkhd->bqhgd", p, v.astype(jnp.float32))
  return m, p.sum(-1), acc


def _output(stats, q):
  """(m, l, acc) -> attention output [b, Tq, Hq, D] in q.dtype."""
  return (stats[2] / stats[1][..., None]).reshape(q.shape).astype(q.dtype)


def _merge(a, b):
  """Online-softmax merge of two (m, l, acc) triples."""
  m = jnp.maximum(a[0], b[0])
  wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
  return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def _grouped(q, k, scale):
  b, tl, hq, d = q.shape
  return q.reshape(b, tl, k.shape[2], hq // k.shape[2], d), d**-0.5 if scale is None else scale


def ring_attention(q, k, v, seg, *, axis, n: int, scale=None):
  """Causal full attention of this shard's queries over all shards' keys, K / V passed around the ring.
  q [b, Tl, Hq, D], k / v [b, Tl, Hkv, D], seg [b, Tl] -> [b, Tl, Hq, D] in q.dtype."""
  qg, scale = _grouped(q, k, scale)
  me = lax.axis_index(axis)
  stats = _block(qg, k, v, seg, seg, scale, q0=0)  # the diagonal block: never empty (a query sees itself)
  empty = (jnp.full_like(stats[0], MASK_VALUE), jnp.zeros_like(stats[1]), jnp.zeros_like(stats[2]))
  perm = [(i, (i + 1) % n) for i in range(n)]
  kseg = seg
  for t in range(1, n):  # after t steps this device holds the block of shard me - t (mod n)
    k, v, kseg = (lax.ppermute(x, axis, perm) for x in (k, v, kseg))
    blk = lax.cond(
      t <= me,  # shard me - t >= 0 lies entirely before this one; otherwise it is in the future: skipped
      lambda k, v, kseg: _block(qg, k, v, seg, kseg, scale),
      lambda k, v, kseg: empty,
      k,
      v,
      kseg,
    )
    stats = _merge(stats, blk)
  return _output(stats, q)


def gathered_attention(q, k, v, seg, *, axis, n: int, scale=None):
  """As ring_attention, with every shard's K / V all-gathered first (one [Tl, T] block per device)."""
  qg, scale = _grouped(q, k, scale)
  k, v, kseg = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v, seg))
  return _output(_block(qg, k, v, seg, kseg, scale, q0=lax.axis_index(axis) * q.shape[1]), q)


def attention(q, k, v, seg, *, axis, n: int, window, full: str, attend, scale=None):
  """This shard's attention: halo exchange for a window shorter than the sequence, else `full` ("ring" |
  "all_gather")."""
  if window is not None and window < n * q.shape[1]:
    return halo_attention(q, k, v, seg, axis=axis, n=n, window=window, attend=attend)
  if full not in FULL_MODES:
    raise ValueError(f"context_full must be one of {FULL_MODES}, got {full!r}")
  fn = ring_attention if full == "ring" else gathered_attention
  return fn(q, k, v, seg, axis=axis, n=n, scale=scale)


def exchange_bytes(args, seq_len: int, context: int, rows: int = 1, tensor: int = 1) -> dict:
  """Bytes one device sends per training step (forward + backward) for attention on `context` shards of
  sequences of `seq_len` tokens, `rows` sequences per device; args: ModelArgs. Per layer:

    SWA (halo):        4 * rows * h * D * a * min(W - 1, (n - 1) Tl)     K, V forward, their gradients back
    full (ring or      4 * rows * h * D * a * (n - 1) Tl                 the same volume either way
      all-gather)
  h = Hkv / tensor (when it divides), a = the activations' itemsize, Tl = seq_len / n. The segment ids travel
  once per step (4 bytes per position; XLA shares them between layers): "ids". tests/test_context_parallel.py
  checks these numbers against the collectives of the compiled step."""
  n, tl = context, seq_len // context
  h = args.num_kv_heads // tensor if args.num_kv_heads % tensor == 0 else args.num_kv_heads
  per_pos = 4 * rows * h * args.head_dim * jnp.dtype(args.dtype).itemsize
  if n == 1:
    return {"swa_layer": 0, "full_layer": 0, "ids": 0, "step": 0}
  halo_len = lambda w: min(w - 1, (n - 1) * tl)
  layers = list(args.layers) + list(args.mtp_layers)
  swa = [halo_len(s.window) for s in layers if s.window is not None and s.window < seq_len]
  n_full = len(layers) - len(swa)
  out = {
    "swa_layer": per_pos * max(swa, default=0),
    "full_layer": per_pos * (n - 1) * tl,
    "ids": 4 * rows * (max(swa, default=0) + (n - 1) * tl * (n_full > 0)),
  }
  out["step"] = per_pos * (sum(swa) + n_full * (n - 1) * tl) + out["ids"]
  return out
