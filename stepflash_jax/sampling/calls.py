"""The cached model calls of the engine (backbone and MTP modules), weight casting and cache rollback."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepflash_jax import model as M
from stepflash_jax.model.moe import stat_layers
from stepflash_jax.model.replay import moe_layer_names
from stepflash_jax.sampling.quantize import quantize_params


def cast_variables(variables, dtype, quantize=None):
  """Weight matrices and the embedding to `dtype`; router kernels, norm scales and router biases stay fp32.
  quantize "int8" | "fp8": the matrices are first fake-quantized per output channel (sampling/quantize.py)."""

  def f(path, x):
    names = [str(getattr(p, "key", "")) for p in path]
    if names[-1] in ("kernel", "embedding") and "router" not in names:
      return x.astype(dtype)
    return x

  def params(p):
    return jax.tree_util.tree_map_with_path(f, quantize_params(p, quantize) if quantize else p)

  return {c: (params(variables[c]) if c == "params" else variables[c]) for c in M.COLLECTIONS if c in variables}


def moe_confidence(stats):
  """({MoE layer: sown routing confidence}, valid tokens it averages over) for one model call."""
  toks = stat_layers(stats, "tokens")
  return stat_layers(stats, "confidence"), (next(iter(toks.values())) if toks else jnp.float32(0))


def model_call(args, v, tokens, positions, segment_ids, cache, cache_index):
  """Cached backbone call -> (logits [B, T, V] fp32, hidden [B, T, H], new cache, {MoE layer: confidence}, tokens,
  {MoE layer: chosen experts int32 [B, T, k]})."""
  out, st = M.apply(
    args, v, tokens, positions=positions, segment_ids=segment_ids, cache=cache, cache_index=cache_index, stats=True
  )
  conf, ntok = moe_confidence(st)
  return out["logits"], out["hidden"], out["cache"], conf, ntok, st["expert_ids"]


def empty_expert_ids(args, batch: int, columns: int) -> dict:
  """{MoE layer: int32 [B, C, k]} filled with experts 0..k-1 (valid ids for columns that are never fed)."""
  ids = jnp.broadcast_to(jnp.arange(args.top_k, dtype=jnp.int32), (batch, columns, args.top_k))
  return {name: ids for name in moe_layer_names(args)}


def record_expert_ids(buf: dict, ids: dict, cols):
  """Write a call's chosen experts {layer: [B, t, k]} into buf {layer: [B, C, k]} at columns cols.. (int or [B])."""
  if not buf:
    return buf
  B, t = next(iter(ids.values())).shape[:2]
  where = jnp.broadcast_to(jnp.asarray(cols, jnp.int32).reshape(-1, 1), (B, 1)) + jnp.arange(t)[None]
  return {k: buf[k].at[jnp.arange(B)[:, None], where].set(ids[k], mode="drop") for k in buf}


def mtp_call(args, v, k, h, tokens, positions, segment_ids, cache, cache_index):
  return M.build(args).apply(
    {c: v[c] for c in M.COLLECTIONS if c in v},
    k,
    h,
    tokens,
    positions,
    segment_ids,
    cache,
    cache_index,
    method="mtp_step",
  )


def rollback(cache, last_pos):
  """Mark every cache entry with a position > last_pos [B] empty (pos = -1): rejected drafts disappear."""

  def f(path, x):
    if str(getattr(path[-1], "key", "")) != "pos":
      return x
    return jnp.where(x > last_pos[:, None], -1, x)  # pos is [..., B, S]

  return jax.tree_util.tree_map_with_path(f, cache)
