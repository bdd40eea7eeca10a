"""Attention per device under parallel.use_mesh: Pallas kernels (which GSPMD cannot partition) and context
parallelism, both through shard_map.

Attention is independent per (sequence, kv head group), so it runs locally on the batch shards (mesh axes of
"batch") and head shards (mesh axes of "heads" = "kv_heads", e.g. tensor) with no communication. When the
"length" dimension is split too (the context axis), the shards of one sequence exchange a halo of keys or K / V
blocks (parallel/context.py). The grouped matmul of the MoE already runs inside the expert-parallel shard_map
(model/moe_parallel.py).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from stepflash_jax import ops
from stepflash_jax.ops.common import resolve_implementation
from stepflash_jax.parallel import context
from stepflash_jax.parallel.mesh import DEFAULT_RULES, as_tuple, axis_sizes, batch_axes, resolve


def _pack(axes):
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def sliding_window_attention(
  q, k, v, *, window, segment_ids=None, implementation=None, scale=None, context_full="ring"
):
  """ops.sliding_window_attention (same arguments and result), per device when a mesh is in context.

  q [B, T, Hq, D], k/v [B, T, Hkv, D], segment_ids [B, T] or None. Batch split over the dividing subset of the
  "batch" mesh axes, T over the "length" axes (context parallelism) when they divide it, heads over the "kv_heads"
  axes when they divide both Hq and Hkv (query head h uses kv head h // G, so contiguous head shards stay
  aligned); otherwise that dimension stays whole. Without a kernel and without a split T, XLA's attention is left
  to GSPMD. context_full: "ring" | "all_gather", the full-attention layers' exchange (parallel/context.py)."""
  f = functools.partial(ops.sliding_window_attention, window=window, implementation=implementation, scale=scale)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return f(q, k, v, segment_ids=segment_ids)
  rules = nn.get_logical_axis_rules() or DEFAULT_RULES
  sizes = axis_sizes(mesh)
  (B, T, Hq, _), Hkv = q.shape, k.shape[2]
  ctx = tuple(a for a in as_tuple(resolve(("length",), rules)[0]) if sizes.get(a, 1) > 1)
  n = math.prod(sizes[a] for a in ctx)
  if T % n:
    ctx, n = (), 1
  if not ctx and resolve_implementation(implementation) != "pallas":
    return f(q, k, v, segment_ids=segment_ids)
  best = tuple(a for a in batch_axes(mesh, B, rules) if a not in ctx)
  heads = tuple(a for a in as_tuple(resolve(("kv_heads",), rules)[0]) if a not in best + ctx)
  if Hkv % math.prod(sizes[a] for a in heads) or Hq % math.prod(sizes[a] for a in heads):
    heads = ()
  b, c, h = _pack(best), _pack(ctx), _pack(heads)
  qkv, seg_spec = P(b, c, h, None), P(b, c)
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None and ctx else segment_ids

  def local(q, k, v, s):
    if not ctx:
      return f(q, k, v, segment_ids=s)
    attend = lambda q, k, v, s: f(q, k, v, segment_ids=s)
    return context.attention(q, k, v, s, axis=c, n=n, window=window, full=context_full, attend=attend, scale=scale)

  # check_vma=False: a pallas_call's outputs carry no varying-axes type (every shard computes its own block)
  shard = functools.partial(jax.shard_map, mesh=mesh, out_specs=qkv, check_vma=False)
  if seg is None:
    return shard(lambda q, k, v: local(q, k, v, None), in_specs=(qkv, qkv, qkv))(q, k, v)
  return shard(local, in_specs=(qkv, qkv, qkv, seg_spec))(q, k, v, seg)
