"""Grouped (ragged) expert matmul in Pallas: gmm (forward) and tgmm (weight gradient), dropless.

    gmm : out[m] = lhs[m] @ rhs[g(m)]                   lhs [M, K], rhs [G, K, N] -> [M, N]  (lhs.dtype)
    tgmm: out[g] = sum_{m in g} lhs[m]^T grad[m]        lhs [M, K], grad [M, N]   -> [G, K, N] (lhs.dtype)
Rows of lhs are sorted by group; group g owns rows [ends[g] - group_sizes[g], ends[g]) with ends = cumsum.
Rows past sum(group_sizes) come out as exactly 0; groups of size 0 give a zero tgmm slice. fp32 accumulation.
custom_vjp of gmm: dlhs = gmm(dout, rhs^T) (rhs read transposed inside the kernel, no copy), drhs = tgmm(lhs, dout).

TPU design (Mosaic, PrefetchScalarGridSpec; also what runs under interpret=True on CPU):
  * `group_metadata` (traced, from group_sizes) lists "visits" = (group, m_tile) pairs in row order: a group
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
GPU (interpret=False on a "gpu" backend): pallas_kernels.gpu.grouped_matmul (Triton lowering, masked stores
instead of scalar prefetch) or, where Pallas' Triton backend is unavailable, lax.ragged_dot(_general).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.sliding_window_attention import resolve_interpret

NN = (((1,), (0,)), ((), ()))  # a @ b
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class _Cfg:
  tile_m: int
  tile_k: int
  tile_n: int
  interpret: bool
  backend: str = "tpu"


def _dot(a, b, dims):
  exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(
    a, b, dims, precision=lax.Precision.HIGHEST if exact else None, preferred_element_type=jnp.float32
  )


def _round_up(x, m):
  return -(-x // m) * m


def _pad2(x, rows, cols):
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


# ----------------------------------------------------------------------------------------------- metadata
def group_metadata(group_sizes, m_pad: int, tm: int, *, with_tail: bool, visit_empty: bool):
  """Visit lists for the grid. Returns (visit_group [V], visit_tile [V], starts [G'], ends [G'], n_visits [1], V).

  G' = G + 1 with the tail group (rows past the sum, up to m_pad), else G. V = m_tiles + G' - 1 (static bound).
  """
  m_tiles = m_pad // tm
  sizes = group_sizes.astype(jnp.int32)
  if with_tail:
    sizes = jnp.concatenate([sizes, jnp.maximum(m_pad - jnp.sum(sizes), 0)[None]])
  ends = jnp.minimum(jnp.cumsum(sizes), m_pad)  # a sum > m_pad (contract violation) is clipped
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  first_tile = jnp.minimum(starts // tm, m_tiles - 1)
  spanned = jnp.where(ends > starts, (ends - 1) // tm - starts // tm + 1, 1 if visit_empty else 0)
  visit_end = jnp.cumsum(spanned)
  n_visits = visit_end[-1]
  n_bound = m_tiles + sizes.shape[0] - 1
  t = jnp.minimum(jnp.arange(n_bound, dtype=jnp.int32), n_visits - 1)  # dead visits repeat the last one
  group = jnp.searchsorted(visit_end, t, side="right").astype(jnp.int32)
  tile = first_tile[group] + t - (visit_end - spanned)[group]
  return group, tile.astype(jnp.int32), starts, ends, n_visits[None].astype(jnp.int32), n_bound


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
    acc_sc[...] += _dot(lhs_ref[...], rhs_ref[...], NT if transpose_rhs else NN)

  @pl.when(live & (kk == k_tiles - 1))
  def _store():
    first_visit = (t == 0) | (tile_ref[jnp.maximum(t - 1, 0)] != tile)
    prev = jnp.where(first_visit, 0.0, out_ref[...].astype(jnp.float32))
    mask = _row_mask(tile, starts_ref, ends_ref, g, acc_sc.shape, tm)
    out_ref[...] = jnp.where(mask, acc_sc[...], prev).astype(out_ref.dtype)


def _gmm_tpu(cfg: _Cfg, lhs, rhs, group_sizes, transpose_rhs=False):
  """lhs [M, K]; rhs [G, K, N] (or [G, N, K] when transpose_rhs) -> [M, N]."""
  m, k = lhs.shape
  n_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
  m_pad, k_pad, n_pad = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
  lhs_p = _pad2(lhs, m_pad, k_pad)
  rhs_p = jnp.pad(
    rhs, ((0, 0), (0, n_pad - n), (0, k_pad - k)) if transpose_rhs else ((0, 0), (0, k_pad - k), (0, n_pad - n))
  )
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
    acc_sc[...] += _dot(x, y, TN)

  @pl.when(last)
  def _store():
    out_ref[...] = acc_sc[...].astype(out_ref.dtype)


def _tgmm_tpu(cfg: _Cfg, lhs, grad, group_sizes, out_dtype):
  m, k = lhs.shape
  n = grad.shape[1]
  n_groups = group_sizes.shape[0]
  tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
  m_pad, k_pad, n_pad = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
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
  )(group, tile, starts, ends, n_vis, _pad2(lhs, m_pad, k_pad), _pad2(grad, m_pad, n_pad))
  return out[:, :k, :n]


# ----------------------------------------------------------------------------------------------- dispatch + vjp
def _gmm_impl(cfg, lhs, rhs, group_sizes, transpose_rhs=False):
  if cfg.backend == "gpu":
    from pallas_kernels.gpu import grouped_matmul as gpu_gmm  # lazy

    return gpu_gmm.gmm_call(cfg, lhs, rhs, group_sizes, transpose_rhs)
  return _gmm_tpu(cfg, lhs, rhs, group_sizes, transpose_rhs)


def _tgmm_impl(cfg, lhs, grad, group_sizes, out_dtype):
  if cfg.backend == "gpu":
    from pallas_kernels.gpu import grouped_matmul as gpu_gmm  # lazy

    return gpu_gmm.tgmm_call(cfg, lhs, grad, group_sizes, out_dtype)
  return _tgmm_tpu(cfg, lhs, grad, group_sizes, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm(cfg, lhs, rhs, group_sizes):
  return _gmm_impl(cfg, lhs, rhs, group_sizes)


def _gmm_fwd(cfg, lhs, rhs, group_sizes):
  return _gmm_impl(cfg, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg, res, dout):
  lhs, rhs, group_sizes = res
  dout = dout.astype(lhs.dtype)
  dlhs = _gmm_impl(cfg, dout, rhs, group_sizes, transpose_rhs=True)  # [M, K] = dout @ rhs[g]^T
  drhs = _tgmm_impl(cfg, lhs, dout, group_sizes, rhs.dtype)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _check(name, x, ndim, what):
  if x.ndim != ndim:
    raise ValueError(f"{name} must be {what}, got shape {x.shape}")


def _make_cfg(tile_m, tile_k, tile_n, interpret):
  for name, v in (("tile_m", tile_m), ("tile_k", tile_k), ("tile_n", tile_n)):
    if not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  interpret = resolve_interpret(interpret)
  backend = "tpu"
  if not interpret and jax.default_backend() == "gpu":
    from pallas_kernels import gpu  # lazy

    if not gpu.triton_available():
      return None
    gpu.check_triton_blocks(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
    backend = "gpu"
  elif not interpret and (tile_m % 8 or tile_k % 128 or tile_n % 128):
    raise ValueError(
      f"on TPU tile_m ({tile_m}) must be a multiple of 8, tile_k ({tile_k}) and tile_n ({tile_n}) multiples of 128"
    )
  return _Cfg(int(tile_m), int(tile_k), int(tile_n), interpret, backend)


def _check_group_sizes(group_sizes, n_groups):
  if group_sizes.shape != (n_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
      f"group_sizes must be an int array [G={n_groups}], got {group_sizes.dtype} shape {group_sizes.shape}"
    )


def gmm(lhs, rhs, group_sizes, *, tile_m=128, tile_k=128, tile_n=128, interpret=None):
  """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes [G] int (sum <= M) -> [M, N] in lhs.dtype.

  Differentiable in lhs and rhs (custom_vjp). Rows past sum(group_sizes) are 0.
  """
  _check("lhs", lhs, 2, "[M, K]")
  _check("rhs", rhs, 3, "[G, K, N]")
  if rhs.shape[1] != lhs.shape[1]:
    raise ValueError(f"rhs [G, K, N] {rhs.shape} must share K with lhs [M, K] {lhs.shape}")
  _check_group_sizes(group_sizes, rhs.shape[0])
  if lhs.shape[0] == 0:
    return jnp.zeros((0, rhs.shape[2]), lhs.dtype)
  cfg = _make_cfg(tile_m, tile_k, tile_n, interpret)
  if cfg is None:
    from pallas_kernels import gpu

    return gpu.xla_gmm(lhs, rhs, group_sizes)
  return _gmm(cfg, lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))


def tgmm(lhs, grad, group_sizes, *, tile_m=128, tile_k=128, tile_n=128, interpret=None):
  """lhs [M, K], grad [M, N], group_sizes [G] -> [G, K, N] in lhs.dtype: per group lhs[rows]^T @ grad[rows]."""
  _check("lhs", lhs, 2, "[M, K]")
  _check("grad", grad, 2, "[M, N]")
  if grad.shape[0] != lhs.shape[0]:
    raise ValueError(f"grad [M, N] {grad.shape} must share M with lhs [M, K] {lhs.shape}")
  if group_sizes.ndim != 1:
    raise ValueError(f"group_sizes must be [G], got shape {group_sizes.shape}")
  _check_group_sizes(group_sizes, group_sizes.shape[0])
  if lhs.shape[0] == 0:
    return jnp.zeros((group_sizes.shape[0], lhs.shape[1], grad.shape[1]), lhs.dtype)
  cfg = _make_cfg(tile_m, tile_k, tile_n, interpret)
  if cfg is None:
    from pallas_kernels import gpu

    return gpu.xla_tgmm(lhs, grad, group_sizes)
  return _tgmm_impl(cfg, lhs, grad.astype(lhs.dtype), group_sizes.astype(jnp.int32), lhs.dtype)


def gmm_with_backend(lhs, rhs, group_sizes, *, tile_m, tile_k, tile_n, interpret, backend):
  """custom_vjp entry with an explicit kernel family ("tpu" or "gpu"); for tests and the benchmark."""
  cfg = _Cfg(int(tile_m), int(tile_k), int(tile_n), bool(interpret), backend)
  return _gmm(cfg, lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))


def tgmm_with_backend(lhs, grad, group_sizes, *, tile_m, tile_k, tile_n, interpret, backend):
  cfg = _Cfg(int(tile_m), int(tile_k), int(tile_n), bool(interpret), backend)
  return _tgmm_impl(cfg, lhs, grad.astype(lhs.dtype), group_sizes.astype(jnp.int32), lhs.dtype)
