"""Sliding-window flash attention kernels for TPU (Mosaic), forward + dq + dk/dv; also what runs interpreted on CPU.

Called through pallas_kernels.vjp (custom_vjp) by pallas_kernels.sliding_window_attention; docs/kernels.md §1.
  * Layout: q/k/v are viewed (free reshape) as [B, T, H*D]; a (block, D) BlockSpec at column-block h selects head h,
    so no transposes are needed (on TPU D must be a multiple of 128; the model uses D = 128).
  * Block skipping: the static list of visited (q_block, k_block) pairs is `common.visited_blocks` (causal upper
    bound from the last real query of the q block, window lower bound from its first query).  The pair list is
    passed as scalar prefetch (SMEM) and the innermost grid axis walks it, so blocks outside the causal window are
    never part of the grid: the cost is ~ T * W / block^2 pairs, not T^2 / 2 block^2.  (SMEM holds 2 int32 per
    pair: T=32K, W=512, 128-blocks -> 1,280 pairs; full causal at 32K -> 32,896 pairs, use larger blocks there if
    SMEM runs short.)
  * Forward grid (B, Hq, pairs): online softmax in VMEM scratch (m, l lane-replicated (bq, 128), acc (bq, D));
    initialised at the first pair of a q block, normalised and written at its last; also writes
    lse = m + log(l) as [B, Hq, 1, T_pad] (lane-major rows) for the backward.
  * GQA: the K/V index maps read kv head h // group; repeated K/V are never materialised.
  * dq kernel: same grid/pairs as the forward.  dk/dv kernel: grid (B, Hkv, pairs sorted by k block, group) with
    the group axis innermost, so the G query heads of one kv head accumulate into one dk/dv scratch (no per-query
    -head dk copies); it works on transposed scores s^T = k q^T (bk, bq) so lse/delta are consumed as rows.
  * Any T: q/k/v are zero-padded to a multiple of lcm(block_q, block_k); padded keys are only visible to padded
    queries (causality), padded query rows are dropped and carry do = 0 in the backward.
  * Masked logits use the finite masks.MASK_VALUE and p is zeroed where masked, so fully masked rows never produce
    NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NN, NT, dot, pad_axis, padded_seq_len, visited_blocks
from pallas_kernels.masks import MASK_VALUE, visible

LANES = 128  # TPU vreg lanes: softmax statistics and q-side segment ids are lane-replicated
SUBLANES = 8  # TPU vreg sublanes: k-side segment ids are sublane-replicated


def check_blocks(block_q, block_k, head_dim):
  """Mosaic tiling: q-side rows (lse, delta, segment ids) put block_q on lanes, scores put block_k on lanes."""
  if block_q % LANES or block_k % LANES or head_dim % LANES:
    raise ValueError(
      f"on TPU block_q ({block_q}), block_k ({block_k}) and head_dim ({head_dim}) must be multiples of {LANES}"
    )


def _pair_arrays(cfg, transpose: bool):
  pairs = visited_blocks(cfg.seq_len, cfg.window, cfg.block_q, cfg.block_k)
  if transpose:
    pairs = sorted(pairs, key=lambda p: (p[1], p[0]))
  arr = np.asarray(pairs, np.int32).reshape(-1, 2)
  return jnp.asarray(arr[:, 0]), jnp.asarray(arr[:, 1]), len(pairs)


def _run_bounds(ids_ref, p, n):
  """Whether step p is the first / last of a run of equal ids_ref entries (the output block is revisited)."""
  cur = ids_ref[p]
  first = (p == 0) | (ids_ref[jnp.maximum(p - 1, 0)] != cur)
  last = (p == n - 1) | (ids_ref[jnp.minimum(p + 1, n - 1)] != cur)
  return first, last


def _compiler_params(n_grid):
  sem = ("parallel", "parallel") + ("arbitrary",) * (n_grid - 2)
  return pltpu.CompilerParams(dimension_semantics=sem)


# ----------------------------------------------------------------------------------------------- forward kernel
def _fwd_kernel(qb_ref, kb_ref, q_ref, k_ref, v_ref, *refs, cfg, n_pairs: int, has_seg: bool):
  if has_seg:
    qseg_ref, kseg_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
  else:
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
  bq, bk = cfg.block_q, cfg.block_k
  p = pl.program_id(2)
  qi, kj = qb_ref[p], kb_ref[p]
  first, last = _run_bounds(qb_ref, p, n_pairs)

  @pl.when(first)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  v = v_ref[...]
  s = dot(q_ref[...], k_ref[...], NT) * cfg.scale  # (bq, bk)
  q_pos = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  k_pos = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  segs = (qseg_ref[:, :1], kseg_ref[:1, :]) if has_seg else (None, None)
  mask = visible(q_pos, k_pos, cfg.window, *segs)
  s = jnp.where(mask, s, MASK_VALUE)

  m_prev, l_prev = m_sc[:, :1], l_sc[:, :1]  # (bq, 1)
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m_prev - m_new)
  prob = jnp.where(mask, jnp.exp(s - m_new), 0.0)
  l_new = alpha * l_prev + jnp.sum(prob, axis=1, keepdims=True)
  pv = dot(prob.astype(v.dtype), v, NN)
  acc_sc[...] = alpha * acc_sc[...] + pv
  m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
  l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

  @pl.when(last)
  def _finish():
    l = l_sc[...]
    l = jnp.where(l == 0.0, 1.0, l)  # only padded rows can see nothing
    o_ref[...] = (acc_sc[...] / l[:, :1]).astype(o_ref.dtype)
    lse = m_sc[...] + jnp.log(l)  # (bq, LANES), lane-replicated
    lse_ref[...] = jnp.transpose(lse)[:1, :]  # (1, bq) row


def _prepare(cfg, q, k, v, segment_ids):
  """Pad T to a multiple of lcm(block_q, block_k) and flatten heads: [B, T_pad, H*D]."""
  b, t, hq, d = q.shape
  t_pad = padded_seq_len(t, cfg.block_q, cfg.block_k)

  def flat(x):
    return pad_axis(x, 1, t_pad).reshape(b, t_pad, x.shape[2] * d)

  segs = ()
  if segment_ids is not None:
    seg = pad_axis(segment_ids.astype(jnp.int32), 1, t_pad, -1)
    segs = (
      jnp.broadcast_to(seg[:, :, None], (b, t_pad, LANES)),  # column layout
      jnp.broadcast_to(seg[:, None, :], (b, SUBLANES, t_pad)),
    )  # row layout
  return t_pad, flat(q), flat(k), flat(v), segs


def forward(cfg, q, k, v, segment_ids):
  """Returns o [B, T, Hq, D] and lse [B, Hq, 1, T_pad] (fp32)."""
  b, t, hq, d = q.shape
  group = hq // k.shape[2]
  bq, bk = cfg.block_q, cfg.block_k
  t_pad, qf, kf, vf, segs = _prepare(cfg, q, k, v, segment_ids)
  qb, kb, n_pairs = _pair_arrays(cfg, transpose=False)

  q_spec = pl.BlockSpec((None, bq, d), lambda b_, h, p, qb_, kb_: (b_, qb_[p], h))
  kv_spec = pl.BlockSpec((None, bk, d), lambda b_, h, p, qb_, kb_: (b_, kb_[p], lax.div(h, group)))
  in_specs = [q_spec, kv_spec, kv_spec]
  if segs:
    in_specs += [
      pl.BlockSpec((None, bq, LANES), lambda b_, h, p, qb_, kb_: (b_, qb_[p], 0)),
      pl.BlockSpec((None, SUBLANES, bk), lambda b_, h, p, qb_, kb_: (b_, 0, kb_[p])),
    ]
  out_specs = [q_spec, pl.BlockSpec((None, None, 1, bq), lambda b_, h, p, qb_, kb_: (b_, h, 0, qb_[p]))]
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(b, hq, n_pairs),
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=[
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, d), jnp.float32),
    ],
  )
  flops = 4 * b * hq * n_pairs * bq * bk * d
  o, lse = pl.pallas_call(
    functools.partial(_fwd_kernel, cfg=cfg, n_pairs=n_pairs, has_seg=bool(segs)),
    out_shape=[jax.ShapeDtypeStruct(qf.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, 1, t_pad), jnp.float32)],
    grid_spec=grid_spec,
    compiler_params=_compiler_params(3),
    interpret=cfg.interpret,
    cost_estimate=pl.CostEstimate(
      flops=flops, transcendentals=b * hq * n_pairs * bq * bk, bytes_accessed=4 * qf.size * q.dtype.itemsize
    ),
    name="swa_fwd",
  )(qb, kb, qf, kf, vf, *segs)
  return o.reshape(b, t_pad, hq, d)[:, :t], lse


# ----------------------------------------------------------------------------------------------- backward kernels
def _dq_kernel(
  qb_ref, kb_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, n_pairs: int, has_seg: bool
):
  if has_seg:
    qseg_ref, kseg_ref, dq_ref, acc_sc = refs
  else:
    dq_ref, acc_sc = refs
  bq, bk = cfg.block_q, cfg.block_k
  p = pl.program_id(2)
  qi, kj = qb_ref[p], kb_ref[p]
  first, last = _run_bounds(qb_ref, p, n_pairs)

  @pl.when(first)
  def _init():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  k = k_ref[...]
  s = dot(q_ref[...], k, NT) * cfg.scale
  q_pos = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  k_pos = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  segs = (qseg_ref[:, :1], kseg_ref[:1, :]) if has_seg else (None, None)
  mask = visible(q_pos, k_pos, cfg.window, *segs)
  lse = jnp.expand_dims(lse_ref[0], -1)  # (bq, 1)
  delta = jnp.expand_dims(delta_ref[0], -1)
  prob = jnp.where(mask, jnp.exp(s - lse), 0.0)
  dp = dot(do_ref[...], v_ref[...], NT)
  ds = prob * (dp - delta)
  acc_sc[...] += dot(ds.astype(k.dtype), k, NN)

  @pl.when(last)
  def _finish():
    dq_ref[...] = (acc_sc[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(
  qb_ref,
  kb_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  *refs,
  cfg,
  n_pairs: int,
  group: int,
  has_seg: bool,
):
  if has_seg:
    kseg_ref, qseg_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs
  else:
    dk_ref, dv_ref, dk_sc, dv_sc = refs
  bq, bk = cfg.block_q, cfg.block_k
  p, g = pl.program_id(2), pl.program_id(3)
  qi, kj = qb_ref[p], kb_ref[p]
  first, last = _run_bounds(kb_ref, p, n_pairs)

  @pl.when(first & (g == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  q, do = q_ref[...], do_ref[...]
  s_t = dot(k_ref[...], q, NT) * cfg.scale  # (bk, bq)
  k_pos = kj * bk + lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
  q_pos = qi * bq + lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
  segs = (qseg_ref[:1, :], kseg_ref[:, :1]) if has_seg else (None, None)
  mask = visible(q_pos, k_pos, cfg.window, *segs)
  p_t = jnp.where(mask, jnp.exp(s_t - lse_ref[...]), 0.0)  # lse row (1, bq)
  dv_sc[...] += dot(p_t.astype(do.dtype), do, NN)
  dp_t = dot(v_ref[...], do, NT)
  ds_t = p_t * (dp_t - delta_ref[...])
  dk_sc[...] += dot(ds_t.astype(q.dtype), q, NN)

  @pl.when(last & (g == group - 1))
  def _finish():
    dk_ref[...] = (dk_sc[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def backward(cfg, q, k, v, segment_ids, o, lse, do):
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  bq, bk = cfg.block_q, cfg.block_k
  t_pad, qf, kf, vf, segs = _prepare(cfg, q, k, v, segment_ids)
  dof = pad_axis(do.astype(q.dtype), 1, t_pad).reshape(qf.shape)
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  delta = pad_axis(delta, 2, t_pad)[:, :, None, :]  # [B, Hq, 1, T_pad]
  seg_args = segs
  flops = 2 * 4 * b * hq * len(visited_blocks(t, cfg.window, bq, bk)) * bq * bk * d

  # dq: same q-major pairs as the forward.
  qb, kb, n_pairs = _pair_arrays(cfg, transpose=False)
  q_spec = pl.BlockSpec((None, bq, d), lambda b_, h, p, qb_, kb_: (b_, qb_[p], h))
  kv_spec = pl.BlockSpec((None, bk, d), lambda b_, h, p, qb_, kb_: (b_, kb_[p], lax.div(h, group)))
  row_spec = pl.BlockSpec((None, None, 1, bq), lambda b_, h, p, qb_, kb_: (b_, h, 0, qb_[p]))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  if segs:
    in_specs += [
      pl.BlockSpec((None, bq, LANES), lambda b_, h, p, qb_, kb_: (b_, qb_[p], 0)),
      pl.BlockSpec((None, SUBLANES, bk), lambda b_, h, p, qb_, kb_: (b_, 0, kb_[p])),
    ]
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, cfg=cfg, n_pairs=n_pairs, has_seg=bool(segs)),
    out_shape=jax.ShapeDtypeStruct(qf.shape, q.dtype),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, hq, n_pairs),
      in_specs=in_specs,
      out_specs=q_spec,
      scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
    ),
    compiler_params=_compiler_params(3),
    interpret=cfg.interpret,
    name="swa_dq",
    cost_estimate=pl.CostEstimate(flops=flops * 3 // 8, transcendentals=0, bytes_accessed=0),
  )(qb, kb, qf, kf, vf, dof, lse, delta, *seg_args)

  # dk, dv: k-major pairs; the query heads of one kv group are the innermost grid axis.
  qb, kb, n_pairs = _pair_arrays(cfg, transpose=True)
  qh_spec = pl.BlockSpec((None, bq, d), lambda b_, h, p, g, qb_, kb_: (b_, qb_[p], h * group + g))
  k_spec = pl.BlockSpec((None, bk, d), lambda b_, h, p, g, qb_, kb_: (b_, kb_[p], h))
  rowh_spec = pl.BlockSpec((None, None, 1, bq), lambda b_, h, p, g, qb_, kb_: (b_, h * group + g, 0, qb_[p]))
  in_specs = [qh_spec, k_spec, k_spec, qh_spec, rowh_spec, rowh_spec]
  if segs:
    in_specs += [
      pl.BlockSpec((None, bk, LANES), lambda b_, h, p, g, qb_, kb_: (b_, kb_[p], 0)),
      pl.BlockSpec((None, SUBLANES, bq), lambda b_, h, p, g, qb_, kb_: (b_, 0, qb_[p])),
    ]
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, cfg=cfg, n_pairs=n_pairs, group=group, has_seg=bool(segs)),
    out_shape=[jax.ShapeDtypeStruct(kf.shape, k.dtype), jax.ShapeDtypeStruct(vf.shape, v.dtype)],
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, hkv, n_pairs, group),
      in_specs=in_specs,
      out_specs=[k_spec, k_spec],
      scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)],
    ),
    compiler_params=_compiler_params(4),
    interpret=cfg.interpret,
    name="swa_dkv",
    cost_estimate=pl.CostEstimate(flops=flops * 5 // 8, transcendentals=0, bytes_accessed=0),
  )(qb, kb, qf, kf, vf, dof, lse, delta, *seg_args)

  unflat = lambda x, h: x.reshape(b, t_pad, h, d)[:, :t]
  return unflat(dq, hq), unflat(dk, hkv), unflat(dv, hkv)
