"""Grouped (ragged) matmul for MoE experts: out[r] = lhs[r] @ rhs[group(r)].

lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G] int32 with sum <= M: rows
[start_g, start_g + group_sizes[g]) belong to group g; rows past sum(group_sizes) are exactly 0 in the output.
Accumulation is fp32, the output has lhs.dtype. Arguments are checked by pallas_kernels.common.check_gmm_args.

Implementations (``implementation=``):
  "reference"  pallas_kernels.reference.gmm_reference: per-row group id (searchsorted over the cumsum) and a masked
               fp32 matmul per group: O(G * M * K * N).
  "xla"        padded tiles in plain XLA, cost O((M + G * tm) * K * N), i.e. it scales with the active rows, not
               with G * M. Each group's rows are moved (a gather) to a layout where every group starts on a tile
               boundary, so each of the W = (M + G * (tm - 1)) // tm tiles of tm rows belongs to one group; one
               batched einsum multiplies every tile by its group's rhs, and a second gather brings the rows back.
               The row moves are permutations, so their gradients are gathers too (custom_vjp: no scatter-add);
               the rhs gather is plain autodiff (a custom_vjp there breaks shard_map's varying-axis types).
               `tile_layout` / `tile_matmul` are the two halves; the model's expert FFN (model/mlp.py) runs all
               three of its matmuls in one such layout.
  "pallas"     pallas_kernels.grouped_matmul.gmm (Mosaic on TPU, Triton on GPU, interpreted on CPU).
  None         "pallas" on TPU and GPU, "xla" on CPU (ops.common.resolve_implementation). On an H200 (README "GPU")
               the Triton gmm ran 16K tokens x top-8 over 288 experts (4096 -> 1280) at ~300 TFLOP/s, where "xla"
               (the expert weights gathered per tile) and lax.ragged_dot (dense over the groups) ran out of memory,
               and at 2K tokens it was 29x faster than ragged_dot (fwd + bwd).
(jax.lax.ragged_dot would be the obvious XLA choice, but on CPU it costs as much as running every group densely.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import check_gmm_args
from pallas_kernels.grouped_matmul import gmm as pallas_gmm
from pallas_kernels.reference import gmm_reference as reference_grouped_matmul
from stepflash_jax.ops.common import resolve_implementation


def _default_tile_m(m: int, g: int) -> int:
  """Row tile tm: the largest power of two <= the mean group size M / G, between 8 and 128.

  The batched einsum always runs W * tm = M + G * (tm - 1) rows (static shapes: the worst-case padding), so a
  smaller tm wastes fewer rows while a bigger one makes fewer, larger matmuls. Measured on CPU (MoE fwd+bwd,
  4096 routed rows, 8 or 16 experts): tm=128 1x, tm=64 1.1-1.2x, tm=256 0.95-1.1x the time.
  """
  tm = 8
  while tm < 128 and 2 * tm * max(g, 1) <= m:
    tm *= 2
  return tm


@jax.custom_vjp
def take_rows(a, idx, inv):
  """a [M, ...] -> [len(idx), ...]: row idx[p] of a, or zeros where idx[p] == M.

  inv is the inverse map (row i of a went to output row inv[i], or inv[i] == len(idx) if no output took it): every
  row of a is taken at most once, so the gradient is a gather by inv instead of a scatter-add.
  """
  return jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])[idx]


def _take_rows_fwd(a, idx, inv):
  return take_rows(a, idx, inv), (idx, inv)


def _take_rows_bwd(res, g):
  idx, inv = res
  return take_rows(g, inv, idx), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def tile_layout(group_sizes, m: int, tile_m: int | None = None):
  """The padded-tile layout of m rows sorted by group (group_sizes [G], sum <= m): every group starts on a tile
  boundary of tm rows. -> (src [P] int32: the row at each padded slot, m = empty; dest [m] int32: each row's padded
  slot, P = none (rows past sum(group_sizes)); tile_group [W] int32: the group of each tile), P = W * tm,
  W = (m + G * (tm - 1)) // tm (the worst case over group sizes summing to <= m)."""
  g = group_sizes.shape[0]
  tm = _default_tile_m(m, g) if tile_m is None else int(tile_m)
  if tm <= 0:
    raise ValueError(f"tile_m must be positive, got {tile_m!r}")
  rows = (m + g * (tm - 1)) // tm * tm
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  padded = (sizes + tm - 1) // tm * tm
  pends = jnp.cumsum(padded)
  pstarts = pends - padded
  p = jnp.arange(rows, dtype=jnp.int32)
  pg = jnp.minimum(jnp.searchsorted(pends, p, side="right"), g - 1).astype(jnp.int32)
  r = p - pstarts[pg]
  src = jnp.where((r < sizes[pg]) & (p < pends[-1]), starts[pg] + r, m)
  i = jnp.arange(m, dtype=jnp.int32)
  ig = jnp.minimum(jnp.searchsorted(ends, i, side="right"), g - 1).astype(jnp.int32)
  dest = jnp.where(i < ends[-1], pstarts[ig] + i - starts[ig], rows)
  return src, dest, pg[::tm]


def tile_matmul(x, rhs, tile_group):
  """x [W, tm, K] (tile w of group tile_group[w]) @ rhs [G, K, N] -> [W, tm, N]: one batched einsum, fp32
  accumulation, x.dtype out. The rhs gather is plain autodiff (a custom_vjp there breaks shard_map's varying-axis
  types) on an fp32 copy of rhs, so a group's weight gradient is summed over its tiles in fp32 (a bf16 scatter-add
  drifted by hundreds of ulps); the forward values are those of rhs itself."""
  w = rhs.astype(jnp.float32)[tile_group].astype(rhs.dtype)  # the same values; the gather's gradient sums in fp32
  y = jnp.einsum("wmk,wkn->wmn", x, w, preferred_element_type=jnp.float32)
  return y.astype(x.dtype)


def tiled_grouped_matmul(lhs, rhs, group_sizes, *, tile_m=None):
  """Padded-tile grouped matmul in plain XLA (see module docstring)."""
  m, k = lhs.shape
  src, dest, tile_group = tile_layout(group_sizes, m, tile_m)
  x = take_rows(lhs, src, dest).reshape(tile_group.shape[0], -1, k)
  return take_rows(tile_matmul(x, rhs, tile_group).reshape(src.shape[0], -1), dest, src)


def resolve(implementation):
  """The grouped matmul's `implementation=None`: "pallas" on TPU and GPU, "xla" on CPU (module docstring)."""
  return resolve_implementation(implementation, gpu="pallas")


def grouped_matmul(lhs, rhs, group_sizes, *, implementation=None, tile_m=None):
  """out[r] = lhs[r] @ rhs[group(r)] for rows sorted by group.

  Args:
    lhs: [M, K]; rhs: [G, K, N]; group_sizes: [G] int32, sum <= M.
    implementation: "reference", "xla", "pallas" or None ("pallas" on TPU and GPU, else "xla").
    tile_m: row tile of the "xla" path (default: see _default_tile_m).
  Returns:
    [M, N] in lhs.dtype (fp32 accumulation); rows past sum(group_sizes) are 0.
  """
  check_gmm_args(lhs, rhs, group_sizes)
  implementation = resolve(implementation)
  if implementation == "reference":
    return reference_grouped_matmul(lhs, rhs, group_sizes)
  if implementation == "pallas":
    return pallas_gmm(lhs, rhs, group_sizes)
  if lhs.shape[0] == 0 or rhs.shape[0] == 0:
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)
  return tiled_grouped_matmul(lhs, rhs, group_sizes, tile_m=tile_m)


__all__ = [
  "grouped_matmul",
  "reference_grouped_matmul",
  "take_rows",
  "tile_layout",
  "tile_matmul",
  "tiled_grouped_matmul",
]
