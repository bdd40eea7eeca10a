"""Grouped expert matmul for NVIDIA GPUs via Pallas' Triton lowering (differentiated by pallas_kernels.vjp).

The Triton backend has no scalar prefetch, so the visit lists of `group_metadata` (same function as the TPU
kernel) are ordinary int32 operands that each program reads with scalar loads:
  * gmm  grid (visits, n_tiles): program (t, j) loops over k tiles of lhs tile visit_tile[t] times rhs block
    visit_group[t] and stores only the rows of its group with a masked store.  Visits of one m tile write disjoint
    rows, so they may run concurrently; the tail group (rows past the sum) stores zeros; dead visits store nothing.
  * tgmm grid (G, k_tiles, n_tiles): program (g, i, j) loops over the m tiles that group g overlaps (dynamic
    bounds from its row start/end) accumulating masked lhs^T @ grad; an empty group loops 0 times -> zeros.
Tiles must be powers of two >= 16 (Triton); fp32 inputs use IEEE fp32 dots (not TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import NN, NT, TN, dot, group_metadata, pad_to, plgpu, round_up


def _params(a, b):
  return plgpu.CompilerParams(num_warps=4 if a * b <= 64 * 64 else 8, num_stages=3)


def _gmm_kernel(
  group_ref,
  tile_ref,
  starts_ref,
  ends_ref,
  nvis_ref,
  lhs_ref,
  rhs_ref,
  out_ref,
  *,
  n_groups,
  tm,
  tk,
  tn,
  k_tiles,
  transpose_rhs,
):
  t, j = pl.program_id(0), pl.program_id(1)
  g, tile = group_ref[t], tile_ref[t]
  rows = pl.ds(tile * tm, tm)
  cols = pl.ds(j * tn, tn)
  g_rhs = jnp.minimum(g, n_groups - 1)

  def body(kk, acc):
    ks = pl.ds(kk * tk, tk)
    w = rhs_ref[g_rhs, cols, ks] if transpose_rhs else rhs_ref[g_rhs, ks, cols]
    return acc + dot(lhs_ref[rows, ks], w, NT if transpose_rhs else NN)

  # k_tiles for a real group, 0 for the tail group (g == n_groups: stores zeros). Integer arithmetic, not jnp.where:
  # jax 0.11's Triton lowering turned where(pred, 1, 0) into an i1 loop bound that fails verification.
  n_steps = jnp.clip((n_groups - g) * k_tiles, 0, k_tiles)
  acc = lax.fori_loop(0, n_steps, body, jnp.zeros((tm, tn), jnp.float32))
  row_ids = tile * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
  mask = (row_ids >= starts_ref[g]) & (row_ids < ends_ref[g]) & (t < nvis_ref[0])
  plgpu.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mask)


def gmm(cfg, lhs, rhs, group_sizes, transpose_rhs=False):
  """lhs [M, K]; rhs [G, K, N] (or [G, N, K] when transpose_rhs) -> [M, N] in lhs.dtype."""
  m, k = lhs.shape
  n_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
  m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
  rhs_p = pad_to(rhs, (n_groups, n_pad, k_pad) if transpose_rhs else (n_groups, k_pad, n_pad))
  group, tile, starts, ends, n_vis, n_bound = group_metadata(group_sizes, m_pad, tm, with_tail=True, visit_empty=False)
  out = pl.pallas_call(
    functools.partial(
      _gmm_kernel, n_groups=n_groups, tm=tm, tk=tk, tn=tn, k_tiles=k_pad // tk, transpose_rhs=transpose_rhs
    ),
    out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), lhs.dtype),
    grid=(n_bound, n_pad // tn),
    compiler_params=_params(tm, tn),
    interpret=cfg.interpret,
    name="gmm_triton",
  )(group, tile, starts, ends, n_vis, pad_to(lhs, (m_pad, k_pad)), rhs_p)
  return out[:m, :n]


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, grad_ref, out_ref, *, tm, tk, tn):
  g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[g], ends_ref[g]
  ks, ns = pl.ds(i * tk, tk), pl.ds(j * tn, tn)

  def body(mt, acc):
    rows = pl.ds(mt * tm, tm)
    row_ids = mt * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    in_group = (row_ids >= start) & (row_ids < end)
    x = jnp.where(in_group, lhs_ref[rows, ks], 0).astype(lhs_ref.dtype)
    y = jnp.where(in_group, grad_ref[rows, ns], 0).astype(grad_ref.dtype)
    return acc + dot(x, y, TN)

  first = lax.div(start, tm)
  last = jnp.where(end > start, lax.div(end + tm - 1, tm), first)  # exclusive
  acc = lax.fori_loop(first, last, body, jnp.zeros((tk, tn), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def tgmm(cfg, lhs, grad, group_sizes, out_dtype):
  """lhs [M, K], grad [M, N] -> [G, K, N] in out_dtype."""
  m, k = lhs.shape
  n = grad.shape[1]
  n_groups = group_sizes.shape[0]
  tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
  m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
  _, _, starts, ends, _, _ = group_metadata(group_sizes, m_pad, tm, with_tail=False, visit_empty=True)
  out = pl.pallas_call(
    functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn),
    out_shape=jax.ShapeDtypeStruct((n_groups, k_pad, n_pad), out_dtype),
    grid=(n_groups, k_pad // tk, n_pad // tn),
    out_specs=pl.BlockSpec((None, tk, tn), lambda g, i, j: (g, i, j)),
    compiler_params=_params(tk, tn),
    interpret=cfg.interpret,
    name="tgmm_triton",
  )(starts, ends, pad_to(lhs, (m_pad, k_pad)), pad_to(grad, (m_pad, n_pad)))
  return out[:, :k, :n]
