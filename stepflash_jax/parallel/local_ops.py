"""Kernels that must see per-device shapes (Pallas) wrapped in shard_map, for use under parallel.use_mesh.

GSPMD cannot partition a Pallas call: called on sharded operands it would gather them. Attention is independent
per (sequence, kv head group), so it runs locally on the batch shards (mesh axes of "batch") and head shards
(mesh axes of "heads" = "kv_heads", e.g. tensor) with no communication. The grouped matmul of the MoE already
runs inside the expert-parallel shard_map (model/moe_parallel.py).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from stepflash_jax import ops
from stepflash_jax.parallel.mesh import DEFAULT_RULES, as_tuple, axis_sizes, batch_axes, resolve


def sliding_window_attention(q, k, v, *, window, segment_ids=None, implementation=None, scale=None):
  """ops.sliding_window_attention (same arguments and result), per device when a mesh is in context.

  q [B, T, Hq, D], k/v [B, T, Hkv, D], segment_ids [B, T] or None. Batch split over the dividing subset of the
  "batch" mesh axes, heads over the "kv_heads" axes when they divide both Hq and Hkv (query head h uses kv head
  h // G, so contiguous head shards stay aligned); otherwise that dimension stays whole."""
  f = lambda q, k, v, s: ops.sliding_window_attention(
    q, k, v, window=window, segment_ids=s, implementation=implementation, scale=scale
  )
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return f(q, k, v, segment_ids)
  rules = nn.get_logical_axis_rules() or DEFAULT_RULES
  sizes = axis_sizes(mesh)
  Hq, Hkv = q.shape[2], k.shape[2]
  best = batch_axes(mesh, q.shape[0], rules)
  heads = tuple(a for a in as_tuple(resolve(("kv_heads",), rules)[0]) if a not in best)
  nh = math.prod(sizes[a] for a in heads)
  if Hkv % nh or Hq % nh:
    heads = ()
  b = None if not best else (best[0] if len(best) == 1 else best)
  h = None if not heads else (heads[0] if len(heads) == 1 else heads)
  qkv = P(b, None, h, None)
  # check_vma=False: a pallas_call's outputs carry no varying-axes type (every shard computes its own block)
  local = functools.partial(jax.shard_map, mesh=mesh, out_specs=qkv, check_vma=False)
  if segment_ids is None:
    return local(lambda q, k, v: f(q, k, v, None), in_specs=(qkv, qkv, qkv))(q, k, v)
  return local(f, in_specs=(qkv, qkv, qkv, P(b, None)))(q, k, v, segment_ids)
