"""Sliding-window (causal, GQA, packed) flash attention in Pallas, forward + backward (FlashAttention-2).

    o_i = sum_j softmax_j(scale * q_i . k_j  |  j <= i, i - j < window, seg_i == seg_j) v_j      (docs/kernels.md §1)

Shapes: q [B, T, Hq, D], k/v [B, T, Hkv, D], Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)),
segment_ids [B, T] int32 or None, window int or None (= full causal). Output [B, T, Hq, D] in q.dtype; logits,
softmax statistics and all accumulators are fp32. The visibility rule is pallas_kernels.masks.visible.

Where it runs is `common.kernel_target(interpret)`, the one platform switch:
  * "interpret" / "tpu": the TPU kernels of pallas_kernels/tpu/attention.py (Mosaic; Pallas' interpreter on CPU).
    Block skipping: only the (q_block, k_block) pairs of `visited_blocks` are part of the grid, so the cost is
    ~ T * W / block^2 block pairs, not T^2 / 2 block^2.
  * "gpu": the Triton kernels of pallas_kernels/gpu/attention.py (same math and the same `kv_block_range` /
    `q_block_range` bounds, used as dynamic loop bounds), through `pallas_kernels.gpu.sliding_window_attention`.
  * "xla": a GPU whose JAX lacks Pallas' Triton backend (deprecated from JAX 0.11): `gpu.xla_attention`
    (jax.nn.dot_product_attention: cuDNN with local_window_size, or an explicit mask when segment ids are given).
Both kernel families are differentiated by the custom_vjp of pallas_kernels.vjp.
"""

from __future__ import annotations

from pallas_kernels import gpu, vjp
from pallas_kernels.common import (
  check_attention_args,
  kernel_target,
  kv_block_range,
  num_visited_blocks,
  q_block_range,
  visited_blocks,
)
from pallas_kernels.tpu import attention as tpu_attention

__all__ = ["kv_block_range", "num_visited_blocks", "q_block_range", "sliding_window_attention", "visited_blocks"]


def sliding_window_attention(
  q, k, v, *, window=None, segment_ids=None, scale=None, block_q=128, block_k=128, interpret=None
):
  """Causal sliding-window GQA attention. q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D] (q.dtype).

  window=None is full causal; segment_ids [B, T] restricts attention to equal ids; scale defaults to D**-0.5.
  interpret=None runs the kernels interpreted on CPU; on a GPU backend the Triton-lowered kernels of
  pallas_kernels.gpu are used. On TPU block_q, block_k and D must be multiples of 128.
  """
  check_attention_args(q, k, v, window, segment_ids, block_q=block_q, block_k=block_k)
  target = kernel_target(interpret)
  if target == "xla":
    return gpu.xla_attention(q, k, v, window=window, segment_ids=segment_ids, scale=scale)
  if target == "gpu":
    return gpu.sliding_window_attention(
      q, k, v, window=window, segment_ids=segment_ids, scale=scale, block_q=block_q, block_k=block_k
    )
  if target == "tpu":
    tpu_attention.check_blocks(block_q, block_k, q.shape[-1])
  return vjp.attention(
    tpu_attention,
    q,
    k,
    v,
    window=window,
    segment_ids=segment_ids,
    scale=scale,
    block_q=block_q,
    block_k=block_k,
    interpret=target == "interpret",
  )
