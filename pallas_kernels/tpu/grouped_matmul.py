"""Grouped expert matmul kernels for TPU (Mosaic, PrefetchScalarGridSpec): gmm and tgmm; they also run interpreted.

Called through pallas_kernels.vjp (custom_vjp) by pallas_kernels.grouped_matmul; docs/kernels.md §2.
  * `common.group_metadata` (traced, from group_sizes) lists "visits" = (group, m_tile) pairs in row order: a group
    visits every tm-row tile it overlaps, so a tile straddling a group boundary is visited once per group.  gmm
    adds a virtual tail group for rows past the sum (visited like a group, its rows are written as zeros);
    tgmm gives an empty group one visit (all rows masked -> zero slice).  The number of visits is dynamic but
    bounded by m_tiles + groups - 1, which is the static grid size; visits past the real count re-point to the
    last real visit (same blocks, so no DMA) and do nothing.
  * The visit -> group and visit -> m_tile maps, group row starts/ends and the visit count are scalar-prefetch
    operands (SMEM) read by the BlockSpec index maps: lhs tile (m_tile[t], k), rhs block (group[t], k, n).
  * gmm grid (n_tiles, visits, k_tiles): fp32 (tm, tn) scratch over k; at the last k step the rows of this
    visit's group are selected into the output tile, which stays resident across consecutive visits of the same
    m tile (the first visit of a tile starts from zeros, so nothing is left uninitialised).
  * tgmm grid (k_tiles, n_tiles, visits): (tk, tn) scratch accumulates masked lhs^T @ grad over the visits of a
    group and is written when the group changes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NN, NT, TN, dot, group_metadata, pad_to, round_up


def check_tiles(tile_m, tile_k, tile_n):
  """Mosaic tiling: rows on sublanes (8), k and n on lanes (128)."""
  if tile_m % 8 or tile_k % 128 or tile_n % 128:
    raise ValueError(
      f"on TPU tile_m ({tile_m}) must be a multiple of 8, tile_k ({tile_k}) and tile_n ({tile_n}) multiples of 128"
    )


def _row_mask(tile, starts_ref, ends_ref, g, shape, tm):
  rows = tile * tm + lax.broadcasted_iota(jnp.int32, shape, 0)
  return (rows >= starts_ref[g]) & (rows < ends_ref[g])


# ----------------------------------------------------------------------------------------------- gmm kernel
def _gmm_kernel(
  group_ref,
  tile_ref,
  starts_ref,
  ends_ref,
  nvis_ref,
  lhs_ref,
  rhs_ref,
  out_ref,
  acc_sc,
  *,
  n_groups,
  tm,
  k_tiles,
  transpose_rhs,
):
  t, kk = pl.program_id(1), pl.program_id(2)
  g, tile = group_ref[t], tile_ref[t]
  live = t < nvis_ref[0]

  @pl.when(kk == 0)
  def _zero():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(live & (g < n_groups))  # the tail group only writes zeros
  def _accumulate():
    acc_sc[...] += dot(lhs_ref[...], rhs_ref[...], NT if transpose_rhs else NN)

  @pl.when(live & (kk == k_tiles - 1))
  def _store():
    first_visit = (t == 0) | (tile_ref[jnp.maximum(t - 1, 0)] != tile)
    prev = jnp.where(first_visit, 0.0, out_ref[...].astype(jnp.float32))
    mask = _row_mask(tile, starts_ref, ends_ref, g, acc_sc.shape, tm)
    out_ref[...] = jnp.where(mask, acc_sc[...], prev).astype(out_ref.dtype)


def gmm(cfg, lhs, rhs, group_sizes, transpose_rhs=False):
  """lhs [M, K]; rhs [G, K, N] (or [G, N, K] when transpose_rhs) -> [M, N]."""
  m, k = lhs.shape
  n_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
  m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
  lhs_p = pad_to(lhs, (m_pad, k_pad))
  rhs_p = pad_to(rhs, (n_groups, n_pad, k_pad) if transpose_rhs else (n_groups, k_pad, n_pad))
  group, tile, starts, ends, n_vis, n_bound = group_metadata(group_sizes, m_pad, tm, with_tail=True, visit_empty=False)
  k_tiles = k_pad // tk

  def rhs_map(j, t, kk, group_, tile_, *_):
    g = jnp.minimum(group_[t], n_groups - 1)
    return (g, j, kk) if transpose_rhs else (g, kk, j)

  rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
  out = pl.pallas_call(
    functools.partial(_gmm_kernel, n_groups=n_groups, tm=tm, k_tiles=k_tiles, transpose_rhs=transpose_rhs),
    out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), lhs.dtype),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(n_pad // tn, n_bound, k_tiles),
      in_specs=[
        pl.BlockSpec((tm, tk), lambda j, t, kk, group_, tile_, *_: (tile_[t], kk)),
        pl.BlockSpec(rhs_block, rhs_map),
      ],
      out_specs=pl.BlockSpec((tm, tn), lambda j, t, kk, group_, tile_, *_: (tile_[t], j)),
      scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    ),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
    interpret=cfg.interpret,
    name="gmm",
    cost_estimate=pl.CostEstimate(
      flops=2 * m_pad * k_pad * n_pad,
      transcendentals=0,
      bytes_accessed=lhs_p.nbytes + rhs_p.nbytes + m_pad * n_pad * lhs.dtype.itemsize,
    ),
  )(group, tile, starts, ends, n_vis, lhs_p, rhs_p)
  return out[:m, :n]


# ----------------------------------------------------------------------------------------------- tgmm kernel
def _tgmm_kernel(
  group_ref, tile_ref, starts_ref, ends_ref, nvis_ref, lhs_ref, grad_ref, out_ref, acc_sc, *, tm, n_bound
):
  t = pl.program_id(2)
  g, tile = group_ref[t], tile_ref[t]
  first = (t == 0) | (group_ref[jnp.maximum(t - 1, 0)] != g)
  last = (t == n_bound - 1) | (group_ref[jnp.minimum(t + 1, n_bound - 1)] != g)

  @pl.when(first)
  def _zero():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(t < nvis_ref[0])
  def _accumulate():
    x, y = lhs_ref[...], grad_ref[...]
    x = jnp.where(_row_mask(tile, starts_ref, ends_ref, g, x.shape, tm), x, jnp.zeros_like(x))
    y = jnp.where(_row_mask(tile, starts_ref, ends_ref, g, y.shape, tm), y, jnp.zeros_like(y))
    acc_sc[...] += dot(x, y, TN)

  @pl.when(last)
  def _store():
    out_ref[...] = acc_sc[...].astype(out_ref.dtype)


def tgmm(cfg, lhs, grad, group_sizes, out_dtype):
  """lhs [M, K], grad [M, N] -> [G, K, N] in out_dtype."""
  m, k = lhs.shape
  n = grad.shape[1]
  n_groups = group_sizes.shape[0]
  tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
  m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
  group, tile, starts, ends, n_vis, n_bound = group_metadata(group_sizes, m_pad, tm, with_tail=False, visit_empty=True)
  out = pl.pallas_call(
    functools.partial(_tgmm_kernel, tm=tm, n_bound=n_bound),
    out_shape=jax.ShapeDtypeStruct((n_groups, k_pad, n_pad), out_dtype),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(k_pad // tk, n_pad // tn, n_bound),
      in_specs=[
        pl.BlockSpec((tm, tk), lambda i, j, t, group_, tile_, *_: (tile_[t], i)),
        pl.BlockSpec((tm, tn), lambda i, j, t, group_, tile_, *_: (tile_[t], j)),
      ],
      out_specs=pl.BlockSpec((None, tk, tn), lambda i, j, t, group_, tile_, *_: (group_[t], i, j)),
      scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    ),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=cfg.interpret,
    name="tgmm",
    cost_estimate=pl.CostEstimate(
      flops=2 * m_pad * k_pad * n_pad,
      transcendentals=0,
      bytes_accessed=(m_pad * (k_pad + n_pad) + n_groups * k_pad * n_pad) * 4,
    ),
  )(group, tile, starts, ends, n_vis, pad_to(lhs, (m_pad, k_pad)), pad_to(grad, (m_pad, n_pad)))
  return out[:, :k, :n]
