"""Expert-parallel routed experts: tokens move to the devices that hold their experts inside jax.shard_map.

Layout (from the logical-axis rules of the enclosing `use_mesh`): tokens [N, H] are split over the mesh axes of
"batch" (data, fsdp, expert), the expert stacks [E, H, F] over the axes of "expert" (EP, E_loc = E / ep experts
per device) and "mlp" (TP: each device holds F / tp columns of every local expert; its partial down-projection
is summed over TP at the end). The H dimension of the weights (split over fsdp for storage) is gathered at the
shard_map boundary, i.e. FSDP. With `chosen` [N, k] global expert ids and `weights` [N, k] (route()), every
strategy computes exactly the single-device result

    y[n] = sum_j weights[n, j] * Expert_{chosen[n, j]}(x[n])          (fp32, [N, H])

and differs only in how tokens reach their experts:

  "gather"  all-gather the tokens of the EP group, every device runs its E_loc experts on the rows routed to them
            (the rest sorted past the grouped matmul, which returns exact zeros), reduce-scatter the partial sums.
            Dropless and exact, runs on every backend (XLA:CPU included); communication ep x tokens.
  "a2a"     fixed-capacity all_to_all: each device sends at most C = ceil(cf * n * k / ep) (token, expert) rows to
            every peer ([ep, C, H] buffers), the peers run their experts and send the rows back. If any device
            would drop a row (a peer gets more than C) the whole step takes the "gather" path (lax.cond): dropless.
  "ragged"  ragged_all_to_all (TPU/GPU): rows sorted by expert are sent as contiguous ragged slices to their
            devices, computed with one grouped matmul per device and returned the same way. Receive buffer:
            cf * n * k rows (cf default = ep: worst case, dropless); overflow falls back to "gather" like a2a.
            XLA:CPU has no ragged-all-to-all, so on CPU `emulate_ragged=True` runs the same program with an
            all-gather based emulation of the collective (tests).
  "auto"    "ragged" on TPU and GPU, "gather" elsewhere.
A strategy may carry a capacity factor: "a2a:1.5", "ragged:2".
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from stepflash_jax.config import parse_expert_parallel
from stepflash_jax.model.mlp import expert_ffn, routed_experts
from stepflash_jax.parallel.mesh import DEFAULT_RULES, resolve

A2A_CAPACITY_FACTOR = 2.0


def current_mesh():
  """The mesh of the enclosing jax.set_mesh / use_mesh, or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def active(mode: str | None) -> bool:
  """True if the MoE should take the shard_map path: a strategy is set and a multi-device mesh is in context."""
  mesh = current_mesh()
  return parse_expert_parallel(mode)[0] != "none" and mesh is not None and mesh.size > 1


def _layout(mesh, E, H, F):
  """(token axes, EP axes, TP axes) from the active logical-axis rules (defaults if none are set)."""
  rules = nn.get_logical_axis_rules() or DEFAULT_RULES
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  tok = resolve(("batch",), rules)[0]
  tok = () if tok is None else ((tok,) if isinstance(tok, str) else tuple(tok))
  tok = tuple(a for a in tok if a in sizes)
  w = resolve(("expert", "embed", "mlp"), rules, sizes, (E, H, F))
  as_t = lambda a: () if a is None else ((a,) if isinstance(a, str) else tuple(a))
  return tok, as_t(w[0]), as_t(w[2]), sizes


# ---------------------------------------------------------------------------------------------------------------
# Local expert computation


def _local_combine(x, chosen, weights, wg, wu, wd, limit, e0, implementation):
  """Tokens x [M, H] routed to global experts chosen [M, k]: fp32 [M, H] = sum over the chosen experts that live
  here (ids e0 .. e0 + E_loc - 1) of weight * expert output (partial over TP if F is split)."""
  E_loc = wg.shape[0]
  loc = chosen - e0
  valid = (loc >= 0) & (loc < E_loc)
  y = expert_ffn(x, jnp.where(valid, loc, E_loc), wg, wu, wd, limit, implementation)  # E_loc: not here -> 0
  return jnp.einsum("mkh,mk->mh", y.astype(jnp.float32), jnp.where(valid, weights, 0.0))


def _counts(ids, n):
  """Histogram of ids [...] in [0, n) -> int32 [n]."""
  return jnp.zeros((n,), jnp.int32).at[ids.reshape(-1)].add(1)


def _psum(x, axes):
  return lax.psum(x, axes) if axes else x


def _linear_index(axes, sizes):
  idx = jnp.int32(0)
  for a in axes:
    idx = idx * sizes[a] + lax.axis_index(a)
  return idx


# ---------------------------------------------------------------------------------------------------------------
# Strategies (bodies of the shard_map; per-device shapes)


def _gather(x, chosen, weights, wg, wu, wd, limit, *, ep_axes, g_axes, rest_axes, tp_axes, sizes, implementation):
  """All-gather the tokens over g_axes, compute local experts, reduce-scatter back; psum over EP axes the tokens
  are replicated on (rest_axes) and over TP."""
  E_loc = wg.shape[0]
  e0 = _linear_index(ep_axes, sizes) * E_loc  # the weight block this device holds
  if g_axes:
    x, chosen, weights = (lax.all_gather(a, g_axes, axis=0, tiled=True) for a in (x, chosen, weights))
  y = _local_combine(x, chosen, weights, wg, wu, wd, limit, e0, implementation)
  if g_axes:
    y = lax.psum_scatter(y, g_axes, scatter_dimension=0, tiled=True)
  return _psum(y, rest_axes + tp_axes)


def _a2a(x, chosen, weights, wg, wu, wd, limit, *, axis, ep, capacity, tp_axes, implementation):
  """Fixed-capacity all_to_all over one mesh axis; returns (y [n, H] fp32 partial over TP, overflow flag)."""
  n, k = chosen.shape
  E_loc, H = wg.shape[0], x.shape[1]
  flat = chosen.reshape(-1)
  dest = flat // E_loc
  order = jnp.argsort(dest, stable=True)
  sdest = dest[order]
  counts = jnp.zeros((ep,), jnp.int32).at[dest].add(1)
  rank = jnp.arange(n * k) - (jnp.cumsum(counts) - counts)[sdest]
  keep = rank < capacity
  slot = jnp.where(keep, rank, capacity)  # capacity = out of bounds: dropped
  buf_x = jnp.zeros((ep, capacity, H), x.dtype).at[sdest, slot].set(x[order // k], mode="drop")
  buf_e = jnp.full((ep, capacity), E_loc, jnp.int32).at[sdest, slot].set(flat[order] - sdest * E_loc, mode="drop")
  recv_x = lax.all_to_all(buf_x, axis, 0, 0)  # [src, C, H]
  recv_e = lax.all_to_all(buf_e, axis, 0, 0)
  out = routed_experts(recv_x.reshape(ep * capacity, H), recv_e.reshape(-1), wg, wu, wd, limit, implementation)
  back = lax.all_to_all(out.reshape(ep, capacity, H), axis, 0, 0)  # [dest, C, H]
  ys = jnp.where(keep[:, None], back[sdest, jnp.minimum(slot, capacity - 1)], 0)
  y = jnp.zeros((n * k, H), x.dtype).at[order].set(ys).reshape(n, k, H)
  y = jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights)
  return _psum(y, tp_axes), jnp.max(counts) > capacity


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """lax.ragged_all_to_all semantics built from all_gather (for backends without the collective)."""
  del recv_sizes
  ep = lax.axis_size(axis_name)
  me = lax.axis_index(axis_name)
  allx = lax.all_gather(operand, axis_name)  # [src, A, H]
  ioff, send, ooff = (lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
  r = jnp.arange(output.shape[0])
  for s in range(ep):
    o, c, i = ooff[s, me], send[s, me], ioff[s, me]
    m = (r >= o) & (r < o + c)
    src = jnp.clip(i + r - o, 0, operand.shape[0] - 1)
    output = jnp.where(m[:, None], allx[s][src], output)
  return output


def _ragged(x, chosen, weights, wg, wu, wd, limit, *, axis, ep, capacity, tp_axes, implementation, emulate):
  """ragged_all_to_all over one mesh axis; returns (y [n, H] fp32 partial over TP, overflow flag)."""
  n, k = chosen.shape
  E_loc, H = wg.shape[0], x.shape[1]
  a2a = _emulated_ragged_all_to_all if emulate else lax.ragged_all_to_all
  flat = chosen.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # by expert = by destination device
  rows = x[order // k]
  counts = jnp.zeros((ep * E_loc,), jnp.int32).at[flat].add(1).reshape(ep, E_loc)
  send = counts.sum(1)
  in_off = jnp.cumsum(send) - send
  recv_counts = lax.all_to_all(counts, axis, 0, 0)  # [src, E_loc]
  recv = recv_counts.sum(1)
  recv_off = jnp.cumsum(recv) - recv  # receive buffer laid out by source
  out_off = lax.all_to_all(recv_off, axis, 0, 0, tiled=True)  # where my slice lands at each peer
  overflow = jnp.sum(recv) > capacity
  recv = jnp.where(overflow, 0, recv)  # overflow: the result is discarded
  send = lax.all_to_all(recv, axis, 0, 0, tiled=True)
  buf = a2a(rows, jnp.zeros((capacity, H), x.dtype), in_off, send, out_off, recv, axis_name=axis)
  ends = jnp.cumsum(jnp.where(overflow, 0, recv_counts).reshape(-1))  # (source, expert) segments of buf
  seg = jnp.searchsorted(ends, jnp.arange(capacity), side="right")
  key = jnp.where(seg < ep * E_loc, seg % E_loc, E_loc)
  out = routed_experts(buf, key, wg, wu, wd, limit, implementation)
  back_off = lax.all_to_all(in_off, axis, 0, 0, tiled=True)  # where each source wants its rows
  ys = a2a(out, jnp.zeros((n * k, H), x.dtype), recv_off, recv, back_off, send, axis_name=axis)
  y = jnp.zeros((n * k, H), x.dtype).at[order].set(ys).reshape(n, k, H)
  y = jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights)
  return _psum(y, tp_axes), overflow


# ---------------------------------------------------------------------------------------------------------------


def moe_experts(
  x,
  chosen,
  weights,
  wg,
  wu,
  wd,
  limit=0.0,
  *,
  mode: str = "auto",
  implementation: str = "xla",
  emulate_ragged: bool | None = None,
):
  """Expert-parallel routed experts on the mesh in context (see module docstring).

  x [N, H], chosen [N, k] int32, weights [N, k] fp32, wg/wu [E, H, F], wd [E, F, H], limit: float or traced
  scalar (clamp, 0 = none) -> fp32 [N, H] = sum_j weights[:, j] * Expert_{chosen[:, j]}(x).
  """
  name, cf = parse_expert_parallel(mode)
  mesh = current_mesh()
  if mesh is None:
    raise ValueError("moe_experts needs a mesh in context (parallel.use_mesh)")
  if name == "auto":
    name = "ragged" if jax.default_backend() in ("tpu", "gpu") else "gather"
  if emulate_ragged is None:
    emulate_ragged = jax.default_backend() not in ("tpu", "gpu")
  N, H = x.shape
  k = chosen.shape[1]
  E, F = wg.shape[0], wg.shape[2]
  tok, ep_axes, tp_axes, sizes = _layout(mesh, E, H, F)
  shards = math.prod(sizes[a] for a in tok)
  pad = -N % shards
  if pad:  # padding rows: expert 0 with weight 0, discarded below
    x = jnp.pad(x, ((0, pad), (0, 0)))
    chosen = jnp.pad(chosen, ((0, pad), (0, 0)))
    weights = jnp.pad(weights, ((0, pad), (0, 0)))
  g_axes = tuple(a for a in tok if a in ep_axes)
  g_axes = tuple(a for a in ep_axes if a in g_axes)  # in EP order, so device d holds experts d*E_loc..
  rest = tuple(a for a in ep_axes if a not in g_axes)
  ep = math.prod(sizes[a] for a in ep_axes)
  n_loc = (N + pad) // shards
  single_axis = len(ep_axes) == 1 and not rest
  if name in ("a2a", "ragged") and not single_axis:
    name = "gather"  # needs tokens split over exactly one EP axis
  wlim = jnp.asarray(limit, jnp.float32)
  static_limit = limit if isinstance(limit, (int, float)) else None

  def body(x, chosen, weights, wg, wu, wd, lim):
    lim = static_limit if static_limit is not None else lim
    operands = (x, chosen, weights, wg, wu, wd, lim)
    common = dict(tp_axes=tp_axes, implementation=implementation)
    gather = lambda: _gather(*operands, ep_axes=ep_axes, g_axes=g_axes, rest_axes=rest, sizes=sizes, **common)
    if name == "gather" or ep == 1:
      return gather()
    E_loc = wg.shape[0]
    if name == "a2a":
      worst = n_loc * k  # all rows of a device to one peer
      cap = max(1, min(worst, math.ceil((cf or A2A_CAPACITY_FACTOR) * n_loc * k / ep)))
      exchange = lambda: _a2a(*operands, axis=ep_axes[0], ep=ep, capacity=cap, **common)[0]
      load = jnp.max(_counts(chosen // E_loc, ep))  # rows this device sends to its busiest peer
    else:
      worst = n_loc * k * ep  # all rows of the EP group to one device
      cap = max(1, min(worst, math.ceil((cf or ep) * n_loc * k)))
      exchange = lambda: _ragged(*operands, axis=ep_axes[0], ep=ep, capacity=cap, emulate=emulate_ragged, **common)[0]
      load = jnp.sum(lax.all_to_all(_counts(chosen // E_loc, ep), ep_axes[0], 0, 0, tiled=True))  # rows received
    if cap >= worst:
      return exchange()  # cannot overflow: no fallback needed
    over = lax.pmax((load > cap).astype(jnp.int32), tuple(mesh.axis_names)) > 0
    return lax.cond(over, gather, exchange)  # dropless: overflow anywhere -> gather path

  pack = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else axes)
  t, e, f = pack(tok), pack(ep_axes), pack(tp_axes)
  y = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P(t, None), P(t, None), P(t, None), P(e, None, f), P(e, None, f), P(e, f, None), P()),
    out_specs=P(t, None),
  )(x, chosen, weights.astype(jnp.float32), wg, wu, wd, wlim)
  return y[:N]
