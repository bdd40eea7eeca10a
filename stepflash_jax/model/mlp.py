"""SwiGLU feed-forward with the optional clamp of docs/architecture.md §5 (dense FFN, the MoE shared expert and its
routed experts).

Clamped SwiGLU: y = (min(silu(x W_gate), L) * clip(x W_up, -L, L)) W_down; L = 0 means no clamp.
"""

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from stepflash_jax import ops
from stepflash_jax.ops.grouped_matmul import resolve, take_rows, tile_layout, tile_matmul


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit) -> jax.Array:
  """Elementwise activation in fp32; `limit` is a Python float or a traced scalar (0 = no clamp)."""
  g = jax.nn.silu(gate.astype(jnp.float32))
  u = up.astype(jnp.float32)
  if isinstance(limit, (int, float)) and limit <= 0:
    return g * u
  lim = jnp.asarray(limit, jnp.float32)
  lim = jnp.where(lim > 0, lim, jnp.inf)
  return jnp.minimum(g, lim) * jnp.clip(u, -lim, lim)


class Weight(nn.Module):
  """One weight leaf named `kernel`, with logical axis names; returned cast to `dtype`."""

  shape: Sequence[int]
  axes: Sequence[str]
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  zero_init: bool = False

  @nn.compact
  def __call__(self):
    init = nn.initializers.zeros_init() if self.zero_init else nn.initializers.normal(stddev=self.init_std)
    w = self.param("kernel", nn.with_logical_partitioning(init, tuple(self.axes)), tuple(self.shape), self.param_dtype)
    return w.astype(self.dtype)


class MLP(nn.Module):
  """x [B, T, H] -> [B, T, H]; gate_proj/up_proj [H, I], down_proj [I, H] (kernels are [in, out])."""

  hidden: int
  width: int
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, limit=0.0):
    kw = dict(init_std=self.init_std, dtype=self.dtype, param_dtype=self.param_dtype)
    wg = Weight((self.hidden, self.width), ("embed", "mlp"), name="gate_proj", **kw)()
    wu = Weight((self.hidden, self.width), ("embed", "mlp"), name="up_proj", **kw)()
    wd = Weight((self.width, self.hidden), ("mlp", "embed"), name="down_proj", **kw)()
    x = x.astype(self.dtype)
    h = clamped_swiglu(x @ wg, x @ wu, limit).astype(self.dtype)
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return h @ wd


def routed_experts(rows, expert, wg, wu, wd, limit, implementation):
  """The expert path: row m of rows [M, H] through SwiGLU expert expert[m] -> [M, H] in rows.dtype.

  expert [M] int in [0, E]; E = no expert (output 0). wg/wu [E, H, F], wd [E, F, H]. Rows are sorted by expert
  (a permutation, gathered both ways) and the experts run as grouped matmuls (ops.grouped_matmul). "xla" (the CPU
  default) runs the whole FFN in one padded-tile layout (ops.grouped_matmul.tile_layout): one row gather in,
  gate, up and down as batched matmuls over the tiles, one gather out (the same products as three separate grouped
  matmuls, which move the rows six times; on the 2-core CPU the train step takes the same time and compiles ~12%
  faster, 2026-12-03).
  """
  M, E = rows.shape[0], wg.shape[0]
  order = jnp.argsort(expert, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(M, dtype=jnp.int32))
  sizes = jnp.zeros((E + 1,), jnp.int32).at[expert].add(1)[:E]  # rows of "no expert" sort past sum(sizes): 0
  if resolve(implementation) == "xla" and M > 0:
    src, dest, tiles = tile_layout(sizes, M)  # in sorted order: compose with the sort
    src, dest = jnp.where(src < M, order[jnp.minimum(src, M - 1)], M), dest[inverse]
    x = take_rows(rows, src, dest).reshape(tiles.shape[0], -1, rows.shape[1])
    h = clamped_swiglu(tile_matmul(x, wg, tiles), tile_matmul(x, wu, tiles), limit).astype(rows.dtype)
    return take_rows(tile_matmul(h, wd, tiles).reshape(src.shape[0], -1), dest, src)
  xs = take_rows(rows, order, inverse)
  gmm = lambda a, w: ops.grouped_matmul(a, w, sizes, implementation=implementation)
  h = clamped_swiglu(gmm(xs, wg), gmm(xs, wu), limit).astype(rows.dtype)
  return take_rows(gmm(h, wd), inverse, order)


def expert_ffn(x, chosen, wg, wu, wd, limit, implementation):
  """Routed experts for x [N, H], chosen [N, k] in [0, E] (E = none: 0) -> [N, k, H], each chosen expert's output."""
  N, k = chosen.shape
  slots = jnp.broadcast_to(x[:, None], (N, k, x.shape[1])).reshape(N * k, -1)
  return routed_experts(slots, chosen.reshape(-1), wg, wu, wd, limit, implementation).reshape(N, k, -1)
