"""Model configuration: an ml_collections ConfigDict, its validation, and the HF config.json mapping.

The config mirrors the released `config.json` (STEP35.md §1): per-layer lists have one entry per decoder layer
*and* per MTP module (45 + 3 = 48 for the full model), so `layer_types[num_layers + k]` describes MTP module k.
`ModelArgs` is the frozen, hashable view that the Flax modules are built from.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import ml_collections
import numpy as np

FULL, SWA = "full_attention", "sliding_attention"
IMPLEMENTATIONS = ("reference", "xla", "pallas")


def model_config(**overrides) -> ml_collections.ConfigDict:
  """Defaults = the published Step 3.5 Flash; see configs/model/*.py for named sizes."""
  L, M = 45, 3
  types = [FULL if i % 4 == 0 else SWA for i in range(L + M)]
  c = ml_collections.ConfigDict(
    dict(
      vocab_size=128896,
      hidden_size=4096,
      head_dim=128,
      num_layers=L,
      num_mtp_layers=M,
      num_heads=64,  # query heads of full-attention layers
      num_heads_swa=96,  # query heads of sliding-window layers (HF: attention_other_setting)
      num_kv_heads=8,  # HF: num_attention_groups
      sliding_window=512,  # keys incl. the current token
      layer_types=types,
      rope_theta=[5e6 if t == FULL else 1e4 for t in types],
      partial_rotary_factors=[0.5 if t == FULL else 1.0 for t in types],
      rope_scaling=dict(
        rope_type="llama3",
        factor=2.0,
        original_max_position_embeddings=131072,
        low_freq_factor=1.0,
        high_freq_factor=32.0,
      ),
      rope_scaling_layer_types=[FULL],  # HF: yarn_only_types — SWA layers are never scaled
      intermediate_size=11264,  # dense FFN (layers 0-2 and every MTP block)
      moe_layers=list(range(3, L)),
      num_experts=288,
      num_experts_per_tok=8,
      moe_intermediate_size=1280,
      shared_expert_intermediate_size=1280,
      routed_scaling_factor=3.0,
      norm_expert_weight=True,
      # 0 = no clamp. Routed experts use swiglu_limits; shared experts and dense FFNs use swiglu_limits_shared.
      swiglu_limits=[7.0 if i in (43, 44) else 0.0 for i in range(L + M)],
      swiglu_limits_shared=[16.0 if i == 44 else 0.0 for i in range(L + M)],
      rms_norm_eps=1e-5,
      max_position_embeddings=262144,
      init_std=0.02,
      # Numerics / implementation switches (not part of the released config).
      dtype="float32",  # activations / matmul inputs; norms, router, softmax, logits always fp32
      param_dtype="float32",
      attention_impl="xla",  # "reference" | "xla" | "pallas" (ops.sliding_window_attention)
      moe_impl="xla",  # "reference" | "xla" | "pallas" (ops.grouped_matmul)
      scan_layers=True,  # compile the repeating 4-layer block once (nn.scan)
      remat=False,  # rematerialise each scanned block in the backward pass
      # Expert parallelism under parallel.use_mesh: "none" (GSPMD decides) | "auto" | "gather" | "a2a" | "ragged",
      # optionally ":<capacity factor>" (see stepflash_jax/parallel/expert_parallel.py). No effect on one device.
      expert_parallel="none",
    )
  )
  c.update(overrides)
  return c


def _check(cond: bool, field: str, msg: str):
  if not cond:
    raise ValueError(f"model config field '{field}': {msg}")


def validate(c) -> None:
  """Raise a one-line ValueError naming the first bad field."""
  for f in (
    "vocab_size",
    "hidden_size",
    "head_dim",
    "num_layers",
    "num_heads",
    "num_heads_swa",
    "num_kv_heads",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
  ):
    _check(int(c[f]) > 0, f, f"must be > 0, got {c[f]}")
  _check(c.num_mtp_layers >= 0, "num_mtp_layers", f"must be >= 0, got {c.num_mtp_layers}")
  _check(
    c.sliding_window is not None and c.sliding_window > 0, "sliding_window", f"must be > 0, got {c.sliding_window}"
  )
  n = c.num_layers + c.num_mtp_layers
  for f in ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared"):
    _check(len(c[f]) == n, f, f"needs num_layers + num_mtp_layers = {n} entries, got {len(c[f])}")
  for i, t in enumerate(c.layer_types):
    _check(t in (FULL, SWA), "layer_types", f"entry {i} is {t!r}; expected {FULL!r} or {SWA!r}")
  for i, p in enumerate(c.partial_rotary_factors):
    rot = p * c.head_dim
    _check(
      0 < p <= 1 and rot == int(rot) and int(rot) % 2 == 0,
      "partial_rotary_factors",
      f"entry {i} = {p} must give an even rotary dim <= head_dim {c.head_dim}",
    )
  _check(all(t > 0 for t in c.rope_theta), "rope_theta", "every theta must be > 0")
  for f in ("num_heads", "num_heads_swa"):
    _check(c[f] % c.num_kv_heads == 0, f, f"{c[f]} is not a multiple of num_kv_heads={c.num_kv_heads}")
  _check(
    c.num_experts_per_tok <= c.num_experts,
    "num_experts_per_tok",
    f"top-k {c.num_experts_per_tok} > num_experts {c.num_experts}",
  )
  _check(all(0 <= i < c.num_layers for i in c.moe_layers), "moe_layers", f"indices must lie in [0, {c.num_layers})")
  _check(
    all(x >= 0 for x in list(c.swiglu_limits) + list(c.swiglu_limits_shared)),
    "swiglu_limits",
    "limits must be >= 0 (0 = no clamp)",
  )
  if c.rope_scaling is not None:
    rs = c.rope_scaling
    _check(
      rs.get("rope_type", "llama3") in ("llama3", "default"),
      "rope_scaling.rope_type",
      f"only 'llama3' is supported, got {rs.get('rope_type')!r}",
    )
    _check(
      rs["high_freq_factor"] > rs["low_freq_factor"], "rope_scaling.high_freq_factor", "must exceed low_freq_factor"
    )
  _check(c.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
  _check(c.attention_impl in IMPLEMENTATIONS, "attention_impl", f"one of {IMPLEMENTATIONS}, got {c.attention_impl!r}")
  _check(c.moe_impl in IMPLEMENTATIONS, "moe_impl", f"one of {IMPLEMENTATIONS}, got {c.moe_impl!r}")
  for f in ("dtype", "param_dtype"):
    _check(c[f] in ("float32", "bfloat16", "float16"), f, f"unsupported dtype {c[f]!r}")
  if "expert_parallel" in c:
    from stepflash_jax.parallel.expert_parallel import parse

    try:
      parse(c.expert_parallel)
    except ValueError as e:
      _check(False, "expert_parallel", str(e))


# ---------------------------------------------------------------------------------------------------------------
# Static per-layer view used by the modules.


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
  expert_parallel: str = "none"  # MoE token exchange under parallel.use_mesh (parallel/expert_parallel.py)


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
  )


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face config.json <-> ConfigDict


def from_hf_config(hf: dict) -> ml_collections.ConfigDict:
  """Read the released Step3p5 `config.json` keys (48-entry per-layer lists, attention_other_setting, ...)."""

  def need(k):
    if k not in hf:
      raise ValueError(f"config.json: missing key '{k}'")
    return hf[k]

  n_lists = len(need("layer_types"))
  mtp = int(hf.get("num_nextn_predict_layers", 0))
  L = int(need("num_hidden_layers"))
  if L + mtp != n_lists and L == n_lists:  # some exports count the MTP layers in num_hidden_layers
    L -= mtp
  moe_layers = hf.get("moe_layers_enum")
  if isinstance(moe_layers, str):
    moe_layers = [int(x) for x in moe_layers.split(",") if x.strip()]
  elif moe_layers is None:
    moe_layers = []
  other = hf.get("attention_other_setting") or {}

  def per_layer(key, default):
    v = hf.get(key, default)
    return [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * n_lists

  scaling = hf.get("rope_scaling")
  if scaling is not None:
    scaling = dict(
      rope_type=scaling.get("rope_type", scaling.get("type", "llama3")),
      factor=float(scaling["factor"]),
      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
    )
  c = model_config(
    vocab_size=int(need("vocab_size")),
    hidden_size=int(need("hidden_size")),
    head_dim=int(hf.get("head_dim", need("hidden_size") // need("num_attention_heads"))),
    num_layers=L,
    num_mtp_layers=mtp,
    num_heads=int(need("num_attention_heads")),
    num_heads_swa=int(other.get("num_attention_heads", need("num_attention_heads"))),
    num_kv_heads=int(need("num_attention_groups")),
    sliding_window=int(hf.get("sliding_window") or 512),
    layer_types=list(hf["layer_types"]),
    rope_theta=per_layer("rope_theta", 10000.0),
    partial_rotary_factors=per_layer("partial_rotary_factors", 1.0),
    rope_scaling=scaling,
    rope_scaling_layer_types=list(hf.get("yarn_only_types", [FULL])),
    intermediate_size=int(need("intermediate_size")),
    moe_layers=moe_layers,
    num_experts=int(hf.get("moe_num_experts", 1)),
    num_experts_per_tok=int(hf.get("moe_top_k", 1)),
    moe_intermediate_size=int(hf.get("moe_intermediate_size", 1)),
    shared_expert_intermediate_size=int(hf.get("share_expert_dim", hf.get("moe_intermediate_size", 1))),
    routed_scaling_factor=float(hf.get("moe_router_scaling_factor", 1.0)),
    norm_expert_weight=bool(hf.get("norm_expert_weight", True)),
    swiglu_limits=per_layer("swiglu_limits", 0.0),
    swiglu_limits_shared=per_layer("swiglu_limits_shared", 0.0),
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
    max_position_embeddings=int(hf.get("max_position_embeddings", hf.get("max_seq_len", 262144))),
  )
  c.update({k: v for k, v in (hf.get("stepflash_jax") or {}).items() if k in _IMPL_KEYS})
  validate(c)
  return c


_IMPL_KEYS = ("dtype", "attention_impl", "moe_impl", "scan_layers", "remat", "expert_parallel")


def to_hf_config(c) -> dict:
  """The inverse of `from_hf_config`, with the released file's key names."""
  return {
    "architectures": ["Step3p5ForCausalLM"],
    "model_type": "step3p5",
    "vocab_size": c.vocab_size,
    "hidden_size": c.hidden_size,
    "head_dim": c.head_dim,
    "num_hidden_layers": c.num_layers,
    "num_nextn_predict_layers": c.num_mtp_layers,
    "num_attention_heads": c.num_heads,
    "num_attention_groups": c.num_kv_heads,
    "attention_other_setting": {
      "attention_type": SWA,
      "num_attention_heads": c.num_heads_swa,
      "num_attention_groups": c.num_kv_heads,
      "head_dim": c.head_dim,
      "true_head_dim": c.head_dim,
    },
    "sliding_window": c.sliding_window,
    "layer_types": list(c.layer_types),
    "rope_theta": list(c.rope_theta),
    "partial_rotary_factors": list(c.partial_rotary_factors),
    "rope_scaling": None if c.rope_scaling is None else dict(c.rope_scaling),
    "yarn_only_types": list(c.rope_scaling_layer_types),
    "intermediate_size": c.intermediate_size,
    "moe_layers_enum": ",".join(str(i) for i in c.moe_layers),
    "use_moe": bool(len(c.moe_layers)),
    "moe_num_experts": c.num_experts,
    "moe_top_k": c.num_experts_per_tok,
    "moe_intermediate_size": c.moe_intermediate_size,
    "share_expert_dim": c.shared_expert_intermediate_size,
    "moe_router_activation": "sigmoid",
    "moe_router_scaling_factor": c.routed_scaling_factor,
    "norm_expert_weight": c.norm_expert_weight,
    "use_moe_router_bias": True,
    "need_fp32_gate": True,
    "swiglu_limits": list(c.swiglu_limits),
    "swiglu_limits_shared": list(c.swiglu_limits_shared),
    "use_head_wise_attn_gate": True,
    "use_qk_norm": True,
    "zero_centered": True,
    "sink": False,
    "tie_word_embeddings": False,
    "rms_norm_eps": c.rms_norm_eps,
    "max_position_embeddings": c.max_position_embeddings,
    "max_seq_len": c.max_position_embeddings,
    "torch_dtype": "bfloat16",
    # Our implementation switches (ignored by other readers), so that load(save(x)) rebuilds the same tree.
    "stepflash_jax": {k: c[k] for k in _IMPL_KEYS if k in c},
  }


def load_config_file(path: str, arg: str | None = None):
  """Call `get_config(arg)` of a Python config file (the big_vision / ml_collections convention)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(f"_cfg_{abs(hash(path))}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg) if arg is not None else mod.get_config()
