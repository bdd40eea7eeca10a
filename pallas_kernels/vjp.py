"""custom_vjp wiring of both ops, shared by the TPU and GPU kernel families.

The static config carries the kernel module (pallas_kernels.tpu.* or pallas_kernels.gpu.*), so this module imports
no kernels and both the public entries and the forced-Triton entries of pallas_kernels.gpu sit above it.
  attention: kernels.forward(cfg, q, k, v, segment_ids) -> (o, lse); kernels.backward(cfg, q, k, v, segment_ids, o,
             lse, do) -> (dq, dk, dv)  (FlashAttention-2: the forward saves the log-sum-exp per query row).
  gmm:       kernels.gmm(cfg, lhs, rhs, group_sizes, transpose_rhs) and kernels.tgmm(cfg, lhs, grad, group_sizes,
             out_dtype); dlhs = gmm(dout, rhs^T) (rhs read transposed inside the kernel), drhs = tgmm(lhs, dout).
Arguments are checked by the callers (pallas_kernels.common.check_*).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  kernels: types.ModuleType
  seq_len: int
  window: int | None
  scale: float
  block_q: int
  block_k: int
  interpret: bool


@dataclasses.dataclass(frozen=True)
class GmmConfig:
  kernels: types.ModuleType
  tile_m: int
  tile_k: int
  tile_n: int
  interpret: bool


# ----------------------------------------------------------------------------------------------- attention
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, segment_ids):
  return cfg.kernels.forward(cfg, q, k, v, segment_ids)[0]


def _attention_fwd(cfg, q, k, v, segment_ids):
  o, lse = cfg.kernels.forward(cfg, q, k, v, segment_ids)
  return o, (q, k, v, segment_ids, o, lse)


def _attention_bwd(cfg, res, do):
  dq, dk, dv = cfg.kernels.backward(cfg, *res, do)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(kernels, q, k, v, *, window, segment_ids, scale, block_q, block_k, interpret):
  """Differentiable sliding-window attention with `kernels`; scale None means D**-0.5."""
  cfg = AttentionConfig(
    kernels=kernels,
    seq_len=q.shape[1],
    window=None if window is None else int(window),
    scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
    block_q=int(block_q),
    block_k=int(block_k),
    interpret=bool(interpret),
  )
  return _attention(cfg, q, k, v, segment_ids)


# ----------------------------------------------------------------------------------------------- grouped matmul
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm(cfg, lhs, rhs, group_sizes):
  return cfg.kernels.gmm(cfg, lhs, rhs, group_sizes)


def _gmm_fwd(cfg, lhs, rhs, group_sizes):
  return cfg.kernels.gmm(cfg, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg, res, dout):
  lhs, rhs, group_sizes = res
  dout = dout.astype(lhs.dtype)
  dlhs = cfg.kernels.gmm(cfg, dout, rhs, group_sizes, transpose_rhs=True)  # [M, K] = dout @ rhs[g]^T
  drhs = cfg.kernels.tgmm(cfg, lhs, dout, group_sizes, rhs.dtype)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _gmm_config(kernels, tile_m, tile_k, tile_n, interpret):
  return GmmConfig(kernels, int(tile_m), int(tile_k), int(tile_n), bool(interpret))


def gmm(kernels, lhs, rhs, group_sizes, *, tile_m, tile_k, tile_n, interpret):
  """Differentiable (lhs, rhs) grouped matmul with `kernels`: [M, K] x [G, K, N] -> [M, N] in lhs.dtype."""
  cfg = _gmm_config(kernels, tile_m, tile_k, tile_n, interpret)
  return _gmm(cfg, lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))


def tgmm(kernels, lhs, grad, group_sizes, *, tile_m, tile_k, tile_n, interpret):
  """Per-group lhs^T @ grad with `kernels`: [M, K] x [M, N] -> [G, K, N] in lhs.dtype (not differentiable)."""
  cfg = _gmm_config(kernels, tile_m, tile_k, tile_n, interpret)
  return kernels.tgmm(cfg, lhs, grad.astype(lhs.dtype), group_sizes.astype(jnp.int32), lhs.dtype)
