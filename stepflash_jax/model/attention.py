"""Attention of one decoder layer (docs/architecture.md §3).

q/k/v/g projections from the normed input, per-head zero-centred QK-norm *before* RoPE (one weight [D] shared by
the heads), partial NeoX RoPE, GQA attention (sliding window or full causal) through
`ops.sliding_window_attention` (per device under a mesh for the Pallas kernel and for context parallelism), a
head-wise sigmoid gate g = sigmoid(x W_g) scaling each head, then o_proj. No biases, no sinks.

Two call modes:
  * training / scoring: `cache=None`, attention over the given sequence (segment ids honoured);
  * cached (prefill and decode): `cache` = {"k": [B, Hkv, S, D], "v": [B, Hkv, D, S], "pos": [B, S] int32 (-1 =
    empty)}, new tokens are written at columns `cache_index + t` (slot = column % S: a ring buffer when S < total
    length, as in sliding-window layers), then the queries attend over the written cache, masked by the stored
    positions. Each of k and v is stored as its product reads it (q.k contracts D, p.v contracts S, both the minor
    axis), so a decode step copies no cache.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels.masks import MASK_VALUE, visible
from stepflash_jax.model.mlp import Weight
from stepflash_jax.model.norms import RMSNorm
from stepflash_jax.model.rope import apply_rope
from stepflash_jax.parallel import local_ops


def cached_attention(q, k, v, q_pos, k_pos, window):
  """Dense masked GQA attention used by the cached path, fp32.

  q [B, Tq, Hq, D], k [B, Hkv, S, D], v [B, Hkv, D, S], q_pos [B, Tq], k_pos [B, S] (-1 = empty slot)
  -> [B, Tq, Hq, D].
  Key j is visible from query i iff 0 <= k_pos[j] <= q_pos[i] and q_pos[i] - k_pos[j] < window.
  """
  B, Tq, Hq, D = q.shape
  Hkv = k.shape[1]
  qg = q.astype(jnp.float32).reshape(B, Tq, Hkv, Hq // Hkv, D) * D**-0.5
  s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(jnp.float32))
  vis = visible(q_pos[:, :, None], k_pos[:, None, :], window, empty_keys=True)  # [B, Tq, S]
  s = jnp.where(vis[:, None, None], s, MASK_VALUE)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgts,bkds->btkgd", p, v.astype(jnp.float32))
  return o.reshape(B, Tq, Hq, D).astype(q.dtype)


def cache_layout(k, v):
  """New keys / values [B, T, Hkv, D] in the cache's layouts: k [B, Hkv, T, D], v [B, Hkv, D, T]."""
  return jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 3, 1))


def write_cache(cache, k, v, pos, index):
  """Write new k/v [B, Tn, Hkv, D] and positions [B, Tn] at columns index..index+Tn-1 (slot = column % S) of a
  cache with k [B, Hkv, S, D], v [B, Hkv, D, S]. `index` is a scalar (one start column for all rows) or int [B]
  (per-row start columns, e.g. speculative decoding where rows advance by different amounts). Returns the written
  cache."""
  S, Tn = cache["pos"].shape[1], k.shape[1]
  index = jnp.asarray(index, jnp.int32)
  if Tn > S:  # only the last S new tokens can survive in the ring
    k, v, pos, index, Tn = k[:, -S:], v[:, -S:], pos[:, -S:], index + Tn - S, S
  if index.ndim == 0:  # k.at[:, :, slots] indexes [B, Hkv, Tn, D], v.at[:, :, :, slots] [B, Hkv, D, Tn]
    rows, slots = slice(None), (index + jnp.arange(Tn)) % S
    k, v = cache_layout(k, v)
  else:  # index arrays rows [B, 1], slots [B, Tn] apart from slices: NumPy puts their [B, Tn] first, [B, Tn, Hkv, D]
    rows, slots = jnp.arange(k.shape[0])[:, None], (index[:, None] + jnp.arange(Tn)) % S
  return {
    "k": cache["k"].at[rows, :, slots].set(k.astype(cache["k"].dtype)),
    "v": cache["v"].at[rows, :, :, slots].set(v.astype(cache["v"].dtype)),
    "pos": cache["pos"].at[rows, slots].set(pos),
  }


class Attention(nn.Module):
  hidden: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  window: int | None
  inv_freq: tuple
  eps: float = 1e-5
  init_std: float = 0.02
  implementation: str = "xla"
  context_full: str = "ring"  # full-attention layers under context parallelism: "ring" | "all_gather"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, positions, segment_ids=None, cache=None, cache_index=None):
    """x [B, T, H] (already normed), positions [B, T] -> ([B, T, H], new cache or None)."""
    H, Hq, Hkv, D = self.hidden, self.num_heads, self.num_kv_heads, self.head_dim
    kw = dict(init_std=self.init_std, dtype=self.dtype, param_dtype=self.param_dtype)
    x = x.astype(self.dtype)
    q = jnp.einsum("bth,hnd->btnd", x, Weight((H, Hq, D), ("embed", "heads", "head_dim"), name="q_proj", **kw)())
    k = jnp.einsum("bth,hnd->btnd", x, Weight((H, Hkv, D), ("embed", "kv_heads", "head_dim"), name="k_proj", **kw)())
    v = jnp.einsum("bth,hnd->btnd", x, Weight((H, Hkv, D), ("embed", "kv_heads", "head_dim"), name="v_proj", **kw)())
    g = jnp.einsum(
      "bth,hn->btn", x, Weight((H, Hq), ("embed", "heads"), name="g_proj", **kw)(), preferred_element_type=jnp.float32
    )
    norm = dict(eps=self.eps, axis_name="head_dim", dtype=self.dtype, param_dtype=self.param_dtype)
    q = apply_rope(RMSNorm(name="q_norm", **norm)(q), positions, self.inv_freq)
    k = apply_rope(RMSNorm(name="k_norm", **norm)(k), positions, self.inv_freq)
    q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
    k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))
    v = nn.with_logical_constraint(v, ("batch", "length", "kv_heads", "head_dim"))

    new_cache = None
    if cache is None:
      # Per device under a mesh when a kernel (Pallas, which GSPMD cannot partition) runs or the sequence is split
      # over the context axis (parallel/local_ops.py); otherwise ops.sliding_window_attention.
      o = local_ops.sliding_window_attention(
        q,
        k,
        v,
        window=self.window,
        segment_ids=segment_ids,
        implementation=self.implementation,
        context_full=self.context_full,
      )
    else:
      valid = jnp.ones(positions.shape, bool) if segment_ids is None else segment_ids > 0
      pos = jnp.where(valid, positions, -1).astype(jnp.int32)
      # Keys: the written cache, when no written slot held an entry a new query still sees (a full-attention cache;
      # a ring whose write fits its lookahead, S >= window + Tn - 1: one decode token, one verify step). A longer
      # chunk into a ring (a prompt, a chat turn) may overwrite such entries: the cache as it was, then the chunk.
      new_cache = write_cache(cache, k, v, pos, cache_index)
      if self.window is None or cache["pos"].shape[1] >= self.window + k.shape[1] - 1:
        keys = new_cache
      else:
        kn, vn = cache_layout(k.astype(cache["k"].dtype), v.astype(cache["v"].dtype))
        keys = {
          "k": jnp.concatenate([cache["k"], kn], 2),
          "v": jnp.concatenate([cache["v"], vn], 3),
          "pos": jnp.concatenate([cache["pos"], pos], 1),
        }
      o = cached_attention(q, keys["k"], keys["v"], pos, keys["pos"], self.window)
    o = o * jax.nn.sigmoid(g)[..., None].astype(o.dtype)  # head-wise output gate
    out = jnp.einsum(
      "btnd,ndh->bth", o.astype(self.dtype), Weight((Hq, D, H), ("heads", "head_dim", "embed"), name="o_proj", **kw)()
    )
    return out, new_cache
