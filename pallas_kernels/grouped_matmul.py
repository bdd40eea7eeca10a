"""Grouped (ragged) expert matmul in Pallas: gmm (forward) and tgmm (weight gradient), dropless.

    gmm : out[m] = lhs[m] @ rhs[g(m)]                   lhs [M, K], rhs [G, K, N] -> [M, N]  (lhs.dtype)
    tgmm: out[g] = sum_{m in g} lhs[m]^T grad[m]        lhs [M, K], grad [M, N]   -> [G, K, N] (lhs.dtype)
Rows of lhs are sorted by group; group g owns rows [ends[g] - group_sizes[g], ends[g]) with ends = cumsum.
Rows past sum(group_sizes) come out as exactly 0; groups of size 0 give a zero tgmm slice. fp32 accumulation.
custom_vjp of gmm (pallas_kernels.vjp): dlhs = gmm(dout, rhs^T) (rhs read transposed inside the kernel, no copy),
drhs = tgmm(lhs, dout). Both kernel families walk the visit lists of `group_metadata` (docs/kernels.md §2).

Where it runs is `common.kernel_target(interpret)`, the one platform switch:
  * "interpret" / "tpu": pallas_kernels/tpu/grouped_matmul.py (Mosaic, scalar-prefetched visit lists; Pallas'
    interpreter on CPU);
  * "gpu": pallas_kernels/gpu/grouped_matmul.py (Triton lowering, masked stores instead of scalar prefetch),
    through `pallas_kernels.gpu.gmm` / `gpu.tgmm`;
  * "xla": a GPU whose JAX lacks Pallas' Triton backend: lax.ragged_dot(_general) (`gpu.xla_gmm` / `gpu.xla_tgmm`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import gpu, vjp
from pallas_kernels.common import check_gmm_args, check_tgmm_args, group_metadata, kernel_target
from pallas_kernels.tpu import grouped_matmul as tpu_gmm

__all__ = ["gmm", "group_metadata", "tgmm"]


def gmm(lhs, rhs, group_sizes, *, tile_m=128, tile_k=128, tile_n=128, interpret=None):
  """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes [G] int (sum <= M) -> [M, N] in lhs.dtype.

  Differentiable in lhs and rhs (custom_vjp). Rows past sum(group_sizes) are 0.
  """
  tiles = dict(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
  check_gmm_args(lhs, rhs, group_sizes, **tiles)
  if lhs.shape[0] == 0:
    return jnp.zeros((0, rhs.shape[2]), lhs.dtype)
  target = kernel_target(interpret)
  if target == "xla":
    return gpu.xla_gmm(lhs, rhs, group_sizes)
  if target == "gpu":
    return gpu.gmm(lhs, rhs, group_sizes, **tiles)
  if target == "tpu":
    tpu_gmm.check_tiles(**tiles)
  return vjp.gmm(tpu_gmm, lhs, rhs, group_sizes, **tiles, interpret=target == "interpret")


def tgmm(lhs, grad, group_sizes, *, tile_m=128, tile_k=128, tile_n=128, interpret=None):
  """lhs [M, K], grad [M, N], group_sizes [G] -> [G, K, N] in lhs.dtype: per group lhs[rows]^T @ grad[rows]."""
  tiles = dict(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
  check_tgmm_args(lhs, grad, group_sizes, **tiles)
  if lhs.shape[0] == 0:
    return jnp.zeros((group_sizes.shape[0], lhs.shape[1], grad.shape[1]), lhs.dtype)
  target = kernel_target(interpret)
  if target == "xla":
    return gpu.xla_tgmm(lhs, grad, group_sizes)
  if target == "gpu":
    return gpu.tgmm(lhs, grad, group_sizes, **tiles)
  if target == "tpu":
    tpu_gmm.check_tiles(**tiles)
  return vjp.tgmm(tpu_gmm, lhs, grad, group_sizes, **tiles, interpret=target == "interpret")
