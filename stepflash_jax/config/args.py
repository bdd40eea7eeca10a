"""ModelArgs: the frozen, hashable view of the ConfigDict that the Flax modules are built from (per-layer specs,
RoPE inverse frequencies, the scan plan)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from stepflash_jax.config.checks import validate
from stepflash_jax.config.defaults import FULL


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """Everything static about one decoder layer (hashable: it parameterises Flax modules)."""

  attn_type: str
  num_heads: int
  window: int | None  # None for full attention
  inv_freq: tuple  # RoPE inverse frequencies (len = rotary_dim / 2)
  moe: bool
  ffn_limit: float  # clamp of the routed experts (moe) or of the dense FFN; 0 = none
  shared_limit: float  # clamp of the shared expert; 0 = none

  def dynamic_key(self):
    """Fields that may differ between scanned copies (passed as scan inputs, not baked in)."""
    return dataclasses.replace(self, ffn_limit=0.0, shared_limit=0.0)


@dataclasses.dataclass(frozen=True)
class ModelArgs:
  vocab_size: int
  hidden_size: int
  head_dim: int
  num_kv_heads: int
  intermediate_size: int
  num_experts: int
  top_k: int
  moe_intermediate_size: int
  shared_intermediate_size: int
  routed_scaling_factor: float
  norm_expert_weight: bool
  eps: float
  init_std: float
  dtype: Any
  param_dtype: Any
  attention_impl: str
  moe_impl: str
  remat: bool
  layers: tuple  # LayerSpec per decoder layer
  mtp_layers: tuple  # LayerSpec per MTP block
  scan: tuple  # (start, period, n_blocks) or () when not scanning
  expert_parallel: str = "none"  # MoE token exchange under parallel.use_mesh (model/moe_parallel.py)
  context_full: str = "ring"  # full-attention layers under context parallelism (parallel/context.py)


def rope_inv_freq(head_dim: int, partial: float, theta: float, scaling: dict | None) -> np.ndarray:
  """Inverse frequencies for the rotated dims; llama3-type scaling (HF `_compute_llama3_parameters`)."""
  rot = int(round(head_dim * partial))
  inv = 1.0 / (theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
  if scaling is None:
    return inv
  factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > old / lo, inv / factor, inv)
  smooth = (old / wavelen - lo) / (hi - lo)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old / hi) & (wavelen <= old / lo)
  return np.where(medium, smoothed, scaled)


def _layer_spec(c, i: int, moe: bool) -> LayerSpec:
  t = c.layer_types[i]
  scaling = dict(c.rope_scaling) if (c.rope_scaling is not None and t in list(c.rope_scaling_layer_types)) else None
  inv = rope_inv_freq(c.head_dim, c.partial_rotary_factors[i], c.rope_theta[i], scaling)
  return LayerSpec(
    attn_type=t,
    num_heads=c.num_heads if t == FULL else c.num_heads_swa,
    window=None if t == FULL else int(c.sliding_window),
    inv_freq=tuple(float(x) for x in inv),
    moe=moe,
    ffn_limit=float(c.swiglu_limits[i] if moe else c.swiglu_limits_shared[i]),
    shared_limit=float(c.swiglu_limits_shared[i]) if moe else 0.0,
  )


def scan_plan(specs: Sequence[LayerSpec]) -> tuple:
  """Pick (start, period, n_blocks) so layers[start : start + period*n_blocks] repeat a block of `period` layers.

  The period is the smallest one of the attention pattern; among starting points the one that leaves the fewest
  layers unrolled wins (ties: the earliest). Returns () if nothing repeats at least twice.
  """
  keys = [s.dynamic_key() for s in specs]
  L = len(keys)
  best, best_cost = (), (L, 0)
  for period in range(1, L // 2 + 1):
    for start in range(L - 2 * period + 1):
      n = 1
      while (
        start + (n + 1) * period <= L
        and keys[start + n * period : start + (n + 1) * period] == keys[start : start + period]
      ):
        n += 1
      cost = (L - n * period, period)
      if n >= 2 and cost < best_cost:
        best, best_cost = (start, period, n), cost
  return best


def model_args(c) -> ModelArgs:
  validate(c)
  moe = set(int(i) for i in c.moe_layers)
  layers = tuple(_layer_spec(c, i, i in moe) for i in range(c.num_layers))
  mtp = tuple(_layer_spec(c, c.num_layers + k, False) for k in range(c.num_mtp_layers))
  import jax.numpy as jnp

  return ModelArgs(
    vocab_size=c.vocab_size,
    hidden_size=c.hidden_size,
    head_dim=c.head_dim,
    num_kv_heads=c.num_kv_heads,
    intermediate_size=c.intermediate_size,
    num_experts=c.num_experts,
    top_k=c.num_experts_per_tok,
    moe_intermediate_size=c.moe_intermediate_size,
    shared_intermediate_size=c.shared_expert_intermediate_size,
    routed_scaling_factor=float(c.routed_scaling_factor),
    norm_expert_weight=bool(c.norm_expert_weight),
    eps=float(c.rms_norm_eps),
    init_std=float(c.init_std),
    dtype=jnp.dtype(c.dtype),
    param_dtype=jnp.dtype(c.param_dtype),
    attention_impl=c.attention_impl,
    moe_impl=c.moe_impl,
    remat=bool(c.remat),
    layers=layers,
    mtp_layers=mtp,
    scan=scan_plan(layers) if c.scan_layers else (),
    expert_parallel=str(c.get("expert_parallel", "none")),
    context_full=str(c.get("context_full", "ring")),
  )
