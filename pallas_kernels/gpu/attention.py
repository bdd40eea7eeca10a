"""Sliding-window GQA flash attention for NVIDIA GPUs via Pallas' Triton lowering (forward + dq + dk/dv).

Same math as the TPU kernels (pallas_kernels/tpu/attention.py); pallas_kernels.vjp differentiates `forward` /
`backward` here when the config names this module. The Triton backend has no scalar prefetch and no scratch, so:
  * forward / dq: grid (q_blocks, B, Hq); the kernel loops over key blocks with lax.fori_loop whose bounds come
    from `kv_block_range` (the TPU kernel's pair list uses the same function), so blocks outside the causal
    window are never touched; accumulators live in registers (loop carry).
  * dk/dv: grid (k_blocks, B, Hkv); loops over the G query heads of the kv group and the query blocks of
    `q_block_range` (exact transpose of kv_block_range); the G heads of a group are one (T, G, D) block, so
    repeated K/V (or per-query-head dK/dV) are never materialised.
Layout stays [B, T, H, D] (no transposes). Blocks and head_dim must be powers of two (Triton). fp32 inputs use
IEEE fp32 dots (not TF32). The backward uses blocks of at most BWD_BLOCK to bound register pressure.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import NN, NT, dot, kv_block_range, pad_axis, padded_seq_len, plgpu, q_block_range
from pallas_kernels.masks import MASK_VALUE, visible

BWD_BLOCK = 64
_TRACED = dict(maximum=jnp.maximum, minimum=jnp.minimum, div=lax.div)


def _params(bq, bk):
  return plgpu.CompilerParams(num_warps=4 if bq * bk <= 64 * 64 else 8, num_stages=2)


# ----------------------------------------------------------------------------------------------- forward
def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg, has_seg):
  seg_ref, o_ref, lse_ref = refs if has_seg else (None, *refs)
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(0)
  lo, hi = kv_block_range(i, seq_len=cfg.seq_len, window=cfg.window, block_q=bq, block_k=bk, **_TRACED)
  q = q_ref[...]
  q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  q_seg = seg_ref[pl.ds(i * bq, bq)][:, None] if has_seg else None

  def body(j, carry):
    acc, m, l = carry
    ks = pl.ds(j * bk, bk)
    k, v = k_ref[ks, :], v_ref[ks, :]
    s = dot(q, k, NT) * cfg.scale
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = visible(q_pos, k_pos, cfg.window, q_seg, seg_ref[ks][None, :] if has_seg else None)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    prob = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(prob, axis=1)
    acc = alpha[:, None] * acc + dot(prob.astype(v.dtype), v, NN)
    return acc, m_new, l

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
  acc, m, l = lax.fori_loop(lo, hi + 1, body, init)
  l = jnp.where(l == 0.0, 1.0, l)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def forward(cfg, q, k, v, segment_ids):
  """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> (o [B, T, Hq, D], lse [B, Hq, T_pad] fp32)."""
  b, t, hq, d = q.shape
  group = hq // k.shape[2]
  bq, bk = cfg.block_q, cfg.block_k
  t_pad = padded_seq_len(t, bq, bk)
  q_spec = pl.BlockSpec((None, bq, None, d), lambda i, b_, h: (b_, i, h, 0))
  kv_spec = pl.BlockSpec((None, t_pad, None, d), lambda i, b_, h: (b_, 0, lax.div(h, group), 0))
  args = [pad_axis(q, 1, t_pad), pad_axis(k, 1, t_pad), pad_axis(v, 1, t_pad)]
  in_specs = [q_spec, kv_spec, kv_spec]
  if segment_ids is not None:
    args.append(pad_axis(segment_ids.astype(jnp.int32), 1, t_pad, -1))
    in_specs.append(pl.BlockSpec((None, t_pad), lambda i, b_, h: (b_, 0)))
  o, lse = pl.pallas_call(
    functools.partial(_fwd_kernel, cfg=cfg, has_seg=segment_ids is not None),
    out_shape=[jax.ShapeDtypeStruct(args[0].shape, q.dtype), jax.ShapeDtypeStruct((b, hq, t_pad), jnp.float32)],
    grid=(t_pad // bq, b, hq),
    in_specs=in_specs,
    out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b_, h: (b_, h, i))],
    compiler_params=_params(bq, bk),
    interpret=cfg.interpret,
    name="swa_fwd_triton",
  )(*args)
  return o[:, :t], lse


# ----------------------------------------------------------------------------------------------- backward
def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, has_seg):
  seg_ref, dq_ref = refs if has_seg else (None, *refs)
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(0)
  lo, hi = kv_block_range(i, seq_len=cfg.seq_len, window=cfg.window, block_q=bq, block_k=bk, **_TRACED)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  q_seg = seg_ref[pl.ds(i * bq, bq)][:, None] if has_seg else None

  def body(j, acc):
    ks = pl.ds(j * bk, bk)
    k, v = k_ref[ks, :], v_ref[ks, :]
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = visible(q_pos, k_pos, cfg.window, q_seg, seg_ref[ks][None, :] if has_seg else None)
    mask = mask & (q_pos < cfg.seq_len)
    prob = jnp.where(mask, jnp.exp(dot(q, k, NT) * cfg.scale - lse), 0.0)
    ds = prob * (dot(do, v, NT) - delta)
    return acc + dot(ds.astype(k.dtype), k, NN)

  acc = lax.fori_loop(lo, hi + 1, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (acc * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, group, has_seg):
  seg_ref, dk_ref, dv_ref = refs if has_seg else (None, *refs)
  bq, bk = cfg.block_q, cfg.block_k
  j = pl.program_id(0)
  lo, hi = q_block_range(j, seq_len=cfg.seq_len, window=cfg.window, block_q=bq, block_k=bk, **_TRACED)
  k, v = k_ref[...], v_ref[...]
  k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
  k_seg = seg_ref[pl.ds(j * bk, bk)][:, None] if has_seg else None

  def head(g, carry):
    def body(i, carry):
      dk, dv = carry
      qs = pl.ds(i * bq, bq)
      q, do = q_ref[qs, g, :], do_ref[qs, g, :]
      q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
      mask = visible(q_pos, k_pos, cfg.window, seg_ref[qs][None, :] if has_seg else None, k_seg)
      mask = mask & (q_pos < cfg.seq_len)
      p_t = jnp.where(mask, jnp.exp(dot(k, q, NT) * cfg.scale - lse_ref[g, qs][None, :]), 0.0)
      dv = dv + dot(p_t.astype(do.dtype), do, NN)
      ds_t = p_t * (dot(v, do, NT) - delta_ref[g, qs][None, :])
      return dk + dot(ds_t.astype(q.dtype), q, NN), dv

    return lax.fori_loop(lo, hi + 1, body, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(cfg, q, k, v, segment_ids, o, lse, do):
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  t_pad = padded_seq_len(t, cfg.block_q, cfg.block_k)  # lse was written with the forward blocks
  cfg = dataclasses.replace(cfg, block_q=min(cfg.block_q, BWD_BLOCK), block_k=min(cfg.block_k, BWD_BLOCK))
  bq, bk = cfg.block_q, cfg.block_k
  has_seg = segment_ids is not None
  qp, kp, vp = pad_axis(q, 1, t_pad), pad_axis(k, 1, t_pad), pad_axis(v, 1, t_pad)
  dop = pad_axis(do.astype(q.dtype), 1, t_pad)
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  delta = pad_axis(delta, 2, t_pad)
  seg = [pad_axis(segment_ids.astype(jnp.int32), 1, t_pad, -1)] if has_seg else []

  q_spec = pl.BlockSpec((None, bq, None, d), lambda i, b_, h: (b_, i, h, 0))
  kv_full = pl.BlockSpec((None, t_pad, None, d), lambda i, b_, h: (b_, 0, lax.div(h, group), 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, b_, h: (b_, h, i))
  seg_spec = [pl.BlockSpec((None, t_pad), lambda i, b_, h: (b_, 0))] if has_seg else []
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, cfg=cfg, has_seg=has_seg),
    out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
    grid=(t_pad // bq, b, hq),
    in_specs=[q_spec, kv_full, kv_full, q_spec, row_spec, row_spec, *seg_spec],
    out_specs=q_spec,
    compiler_params=_params(bq, bk),
    interpret=cfg.interpret,
    name="swa_dq_triton",
  )(qp, kp, vp, dop, lse, delta, *seg)

  qg_spec = pl.BlockSpec((None, t_pad, group, d), lambda j, b_, h: (b_, 0, h, 0))
  k_spec = pl.BlockSpec((None, bk, None, d), lambda j, b_, h: (b_, j, h, 0))
  rows_spec = pl.BlockSpec((None, group, t_pad), lambda j, b_, h: (b_, h, 0))
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, cfg=cfg, group=group, has_seg=has_seg),
    out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)],
    grid=(t_pad // bk, b, hkv),
    in_specs=[qg_spec, k_spec, k_spec, qg_spec, rows_spec, rows_spec, *seg_spec],
    out_specs=[k_spec, k_spec],
    compiler_params=_params(bq, bk),
    interpret=cfg.interpret,
    name="swa_dkv_triton",
  )(qp, kp, vp, dop, lse, delta, *seg)
  return dq[:, :t], dk[:, :t], dv[:, :t]
