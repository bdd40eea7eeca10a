"""Sliding-window (causal, GQA, packed) flash attention in Pallas, forward + backward (FlashAttention-2).

    o_i = sum_j softmax_j(scale * q_i . k_j  |  j <= i, i - j < window, seg_i == seg_j) v_j      (STEP35.md §1)

Shapes: q [B, T, Hq, D], k/v [B, T, Hkv, D], Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)),
segment_ids [B, T] int32 or None, window int or None (= full causal). Output [B, T, Hq, D] in q.dtype; logits,
softmax statistics and all accumulators are fp32.

TPU design (Mosaic; also what runs under interpret=True on CPU):
  * Layout: q/k/v are viewed (free reshape) as [B, T, H*D]; a (block, D) BlockSpec at column-block h selects head h,
    so no transposes are needed (on TPU D must be a multiple of 128; the model uses D = 128).
  * Block skipping: the static list of visited (q_block, k_block) pairs comes from `kv_block_range` (causal upper
    bound from the last real query of the q block, window lower bound from its first query).  The pair list is
    passed as scalar prefetch (SMEM) and the innermost grid axis walks it, so blocks outside the causal window are
    never part of the grid: the cost is ~ T * W / block^2 pairs, not T^2 / 2 block^2.  `visited_blocks` returns
    the very list the kernels iterate over.  (SMEM holds 2 int32 per pair: T=32K, W=512, 128-blocks -> 1,280
    pairs; full causal at 32K -> 32,896 pairs, use larger blocks there if SMEM runs short.)
  * Forward grid (B, Hq, pairs): online softmax in VMEM scratch (m, l lane-replicated (bq, 128), acc (bq, D));
    initialised at the first pair of a q block, normalised and written at its last; also writes
    lse = m + log(l) as [B, Hq, 1, T_pad] (lane-major rows) for the backward.
  * GQA: the K/V index maps read kv head h // group; repeated K/V are never materialised.
  * dq kernel: same grid/pairs as the forward.  dk/dv kernel: grid (B, Hkv, pairs sorted by k block, group) with
    the group axis innermost, so the G query heads of one kv head accumulate into one dk/dv scratch (no per-query
    -head dk copies); it works on transposed scores s^T = k q^T (bk, bq) so lse/delta are consumed as rows.
  * Any T: q/k/v are zero-padded to a multiple of lcm(block_q, block_k); padded keys are only visible to padded
    queries (causality), padded query rows are dropped and carry do = 0 in the backward.
  * Masked logits use a finite -1e30 and p is zeroed where masked, so fully masked rows never produce NaN.

GPU path: `pallas_kernels.gpu.attention` (Pallas Triton lowering, chosen when interpret is False and the default
backend is "gpu"): same math and the same `kv_block_range`/`q_block_range` bounds, used as dynamic fori_loop bounds
because the Triton backend has neither scalar prefetch nor scratch; it is selected explicitly with
`pallas.triton.CompilerParams` (the default GPU backend of pallas_call is Mosaic GPU).  JAX >= 0.11 deprecates
Pallas' Triton backend (jax-triton 0.4 needs jax >= 0.11 / Python >= 3.12); where it cannot be imported
(`gpu.triton_available()` False) this function falls back to `gpu.xla_attention` (jax.nn.dot_product_attention:
cuDNN with local_window_size, or an explicit mask when segment ids are given).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # TPU vreg lanes: softmax statistics and q-side segment ids are lane-replicated
SUBLANES = 8  # TPU vreg sublanes: k-side segment ids are sublane-replicated
MASK_VALUE = -1e30  # finite, so exp(MASK - MASK) never yields NaN
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b


# ----------------------------------------------------------------------------------------------- block bounds
def kv_block_range(q_block, *, seq_len, window, block_q, block_k, maximum=max, minimum=min, div=operator.floordiv):
  """Inclusive (first, last) key block that query block `q_block` can see.

  Works on python ints and (with maximum=jnp.maximum, minimum=jnp.minimum, div=lax.div) on traced int32.
  Last: the block of the last *real* query (causal). First: the block of its first query's oldest key.
  """
  q_first = q_block * block_q
  q_last = minimum(q_first + block_q, seq_len) - 1
  first = 0 if window is None else div(maximum(q_first - window + 1, 0), block_k)
  return first, div(q_last, block_k)


def q_block_range(k_block, *, seq_len, window, block_q, block_k, maximum=max, minimum=min, div=operator.floordiv):
  """Inclusive (first, last) query block that sees key block `k_block`: the exact transpose of kv_block_range."""
  del maximum
  n_q = -(-seq_len // block_q)
  first = div(k_block * block_k, block_q)
  if window is None:
    return first, n_q - 1
  return first, minimum(div(k_block * block_k + block_k + window - 2, block_q), n_q - 1)


def visited_blocks(seq_len: int, window: int | None, block_q: int, block_k: int) -> list[tuple[int, int]]:
  """(q_block, k_block) pairs the kernels compute, q-major; the exact list fed to the kernels' grid."""
  pairs = []
  for qi in range(-(-seq_len // block_q)):
    lo, hi = kv_block_range(qi, seq_len=seq_len, window=window, block_q=block_q, block_k=block_k)
    pairs.extend((qi, kj) for kj in range(lo, hi + 1))
  return pairs


def num_visited_blocks(seq_len: int, window: int | None, block_q: int = 128, block_k: int = 128) -> int:
  return len(visited_blocks(seq_len, window, block_q, block_k))


# ----------------------------------------------------------------------------------------------- helpers
@dataclasses.dataclass(frozen=True)
class _Cfg:
  seq_len: int
  window: int | None
  scale: float
  block_q: int
  block_k: int
  interpret: bool
  backend: str = "tpu"  # "tpu": the kernels below (also interpret mode); "gpu": pallas_kernels.gpu.attention


def resolve_interpret(interpret):
  return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def check_attention_args(q, k, v, window, segment_ids, block_q, block_k):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"k and v must be [B, T, Hkv, D] with equal shapes, got k {k.shape}, v {v.shape}")
  if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise ValueError(f"q, k, v must share one float dtype (f32/bf16/f16), got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, hq, d = q.shape
  if (k.shape[0], k.shape[1], k.shape[3]) != (b, t, d):
    raise ValueError(f"k {k.shape} does not match q {q.shape} in batch, length or head_dim")
  if hq % k.shape[2]:
    raise ValueError(f"query heads ({hq}, q {q.shape}) must be a multiple of kv heads ({k.shape[2]}, k {k.shape})")
  if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
    raise ValueError(f"window must be a positive int or None, got {window!r}")
  if segment_ids is not None and tuple(segment_ids.shape) != (b, t):
    raise ValueError(f"segment_ids must be [B, T] = {(b, t)}, got shape {segment_ids.shape}")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    if not isinstance(blk, (int, np.integer)) or blk < 1:
      raise ValueError(f"{name} must be a positive int, got {blk!r}")


def dot(a, b, dims):
  """fp32-accumulating dot_general; fp32 inputs use full fp32 precision (not bf16/TF32 passes)."""
  exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(
    a, b, dims, precision=lax.Precision.HIGHEST if exact else None, preferred_element_type=jnp.float32
  )


def _visible(q_pos, k_pos, window, q_seg, k_seg):
  """Boolean visibility for broadcastable position/segment arrays (either score orientation)."""
  mask = k_pos <= q_pos
  if window is not None:
    mask = mask & (q_pos - k_pos < window)
  if q_seg is not None:
    mask = mask & (q_seg == k_seg)
  return mask


def _pair_arrays(cfg: _Cfg, transpose: bool):
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
def _fwd_kernel(qb_ref, kb_ref, q_ref, k_ref, v_ref, *refs, cfg: _Cfg, n_pairs: int, has_seg: bool):
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
  mask = _visible(q_pos, k_pos, cfg.window, *segs)
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
  t_pad = -(-t // math.lcm(cfg.block_q, cfg.block_k)) * math.lcm(cfg.block_q, cfg.block_k)

  def flat(x):
    x = jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    return x.reshape(b, t_pad, x.shape[2] * d)

  segs = ()
  if segment_ids is not None:
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, t_pad - t)), constant_values=-1)
    segs = (
      jnp.broadcast_to(seg[:, :, None], (b, t_pad, LANES)),  # column layout
      jnp.broadcast_to(seg[:, None, :], (b, SUBLANES, t_pad)),
    )  # row layout
  return t_pad, flat(q), flat(k), flat(v), segs


def _forward(cfg: _Cfg, q, k, v, segment_ids):
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
  qb_ref, kb_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Cfg, n_pairs: int, has_seg: bool
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
  mask = _visible(q_pos, k_pos, cfg.window, *segs)
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
  cfg: _Cfg,
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
  mask = _visible(q_pos, k_pos, cfg.window, *segs)
  p_t = jnp.where(mask, jnp.exp(s_t - lse_ref[...]), 0.0)  # lse row (1, bq)
  dv_sc[...] += dot(p_t.astype(do.dtype), do, NN)
  dp_t = dot(v_ref[...], do, NT)
  ds_t = p_t * (dp_t - delta_ref[...])
  dk_sc[...] += dot(ds_t.astype(q.dtype), q, NN)

  @pl.when(last & (g == group - 1))
  def _finish():
    dk_ref[...] = (dk_sc[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _backward(cfg: _Cfg, q, k, v, segment_ids, o, lse, do):
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  bq, bk = cfg.block_q, cfg.block_k
  t_pad, qf, kf, vf, segs = _prepare(cfg, q, k, v, segment_ids)
  dof = jnp.pad(do.astype(q.dtype), ((0, 0), (0, t_pad - t), (0, 0), (0, 0))).reshape(qf.shape)
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, t_pad - t)))[:, :, None, :]  # [B, Hq, 1, T_pad]
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


# ----------------------------------------------------------------------------------------------- custom_vjp + API
def _kernels(cfg):
  if cfg.backend == "gpu":
    from pallas_kernels.gpu import attention as gpu_attention  # lazy: it imports this module

    return gpu_attention.forward, gpu_attention.backward
  return _forward, _backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swa(cfg, q, k, v, segment_ids):
  return _kernels(cfg)[0](cfg, q, k, v, segment_ids)[0]


def _swa_fwd(cfg, q, k, v, segment_ids):
  o, lse = _kernels(cfg)[0](cfg, q, k, v, segment_ids)
  return o, (q, k, v, segment_ids, o, lse)


def _swa_bwd(cfg, res, do):
  q, k, v, segment_ids, o, lse = res
  dq, dk, dv = _kernels(cfg)[1](cfg, q, k, v, segment_ids, o, lse, do)
  return dq, dk, dv, None


_swa.defvjp(_swa_fwd, _swa_bwd)


def sliding_window_attention(
  q, k, v, *, window=None, segment_ids=None, scale=None, block_q=128, block_k=128, interpret=None
):
  """Causal sliding-window GQA attention. q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D] (q.dtype).

  window=None is full causal; segment_ids [B, T] restricts attention to equal ids; scale defaults to D**-0.5.
  interpret=None runs the kernels interpreted on CPU; on a GPU backend the Triton-lowered kernels of
  pallas_kernels.gpu are used. On TPU block_q, block_k and D must be multiples of 128.
  """
  check_attention_args(q, k, v, window, segment_ids, block_q, block_k)
  interpret = resolve_interpret(interpret)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  window = None if window is None else int(window)
  backend = "tpu"
  if not interpret and jax.default_backend() == "gpu":
    from pallas_kernels import gpu  # lazy: gpu imports this module

    if not gpu.triton_available():
      return gpu.xla_attention(q, k, v, window=window, segment_ids=segment_ids, scale=scale)
    backend = "gpu"
    gpu.check_triton_blocks(block_q=block_q, block_k=block_k, head_dim=q.shape[-1])
  elif not interpret and (block_q % LANES or block_k % LANES or q.shape[-1] % LANES):
    # q-side rows (lse, delta, segment ids) put block_q on lanes, scores put block_k on lanes
    raise ValueError(
      f"on TPU block_q ({block_q}), block_k ({block_k}) and head_dim (q {q.shape}) must be multiples of {LANES}"
    )
  return attention_with_backend(
    q,
    k,
    v,
    window=window,
    segment_ids=segment_ids,
    scale=scale,
    block_q=block_q,
    block_k=block_k,
    interpret=interpret,
    backend=backend,
  )


def attention_with_backend(q, k, v, *, window, segment_ids, scale, block_q, block_k, interpret, backend):
  """The custom_vjp entry with an explicit kernel family ("tpu" or "gpu"); used by tests and the benchmark."""
  cfg = _Cfg(
    seq_len=q.shape[1],
    window=window,
    scale=float(scale),
    block_q=int(block_q),
    block_k=int(block_k),
    interpret=bool(interpret),
    backend=backend,
  )
  return _swa(cfg, q, k, v, segment_ids)
