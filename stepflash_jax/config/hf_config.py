"""Hugging Face config.json <-> ConfigDict (the released checkpoint's field names)."""

from __future__ import annotations

import ml_collections

from stepflash_jax.checks import is_int, is_number
from stepflash_jax.config.checks import validate
from stepflash_jax.config.defaults import FULL, SWA, model_config


# config.json settings the reference reads that this model implements one way only (sigmoid routing with a bias,
# the head-wise gate, an untied head); with a router bias the reference ignores moe_router_activation
UNSUPPORTED = dict(use_moe_router_bias=True, use_head_wise_attn_gate=True, tie_word_embeddings=False)


def _number(key: str, v, cast=int):
  """v as an int (cast=int: integral values only) or a float, or a ValueError naming config.json's key."""
  if not (is_int(v) or (is_number(v) and (cast is float or float(v).is_integer()))):
    raise ValueError(f"config.json: '{key}' must be {'an integer' if cast is int else 'a number'}, got {v!r}")
  return cast(v)


def _section(hf: dict, key: str) -> dict:
  """hf[key] as a dict ({} when absent or null), or a ValueError naming the key."""
  v = hf.get(key) or {}
  if not isinstance(v, dict):
    raise ValueError(f"config.json: '{key}' must be an object, got {v!r}")
  return v


def _names(hf: dict, key: str, default: list) -> list:
  """hf[key] as a list of strings (`default` when absent), or a ValueError naming the key."""
  v = hf.get(key, default)
  if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
    raise ValueError(f"config.json: '{key}' must be a list of strings, got {v!r}")
  return list(v)


def _check_supported(hf: dict) -> None:
  """ValueError naming a config.json setting this model implements one way only (UNSUPPORTED, RoPE on every layer,
  one KV head count for both attention types)."""
  for key, value in UNSUPPORTED.items():
    if key in hf and hf[key] is not None and hf[key] != value:
      raise ValueError(f"config.json: '{key}' = {hf[key]!r} is not supported (this model implements {value!r})")
  if not all(hf.get("use_rope_layers") or [True]):
    raise ValueError("config.json: 'use_rope_layers' turns RoPE off on some layers; not supported")
  kv, other = hf.get("num_attention_groups"), _section(hf, "attention_other_setting")
  key = "attention_other_setting.num_attention_groups"
  if kv is not None and _number(key, other.get("num_attention_groups", kv)) != _number("num_attention_groups", kv):
    raise ValueError(
      f"config.json: 'attention_other_setting.num_attention_groups' = {other['num_attention_groups']} differs "
      f"from 'num_attention_groups' = {kv}; this model has one KV head count for every layer"
    )


def from_hf_config(hf: dict) -> ml_collections.ConfigDict:
  """Read the released Step3p5 `config.json` keys (48-entry per-layer lists, attention_other_setting, ...).

  A missing key means what it means to the reference (the remote modeling code with vLLM's Step3p5Config): no
  `moe_layers_enum` = MoE on layers 1..L-1, no `share_expert_dim` = moe_intermediate_size * moe_top_k, MoE sizes
  16 experts / top-4 / width 10240, a null `sliding_window` = no window on the sliding layers, a null clamp = none.
  Settings this model does not implement (no router bias, no head-wise gate, a tied head, layers without RoPE)
  raise ValueError naming the key.
  """

  def need(k):
    if k not in hf:
      raise ValueError(f"config.json: missing key '{k}'")
    return hf[k]

  def num(k, default=None, cast=int):
    """hf[k] (or `default` when absent; required when None) as an int / float, or a ValueError naming k."""
    return _number(k, need(k) if default is None else hf.get(k, default), cast)

  def nullable(k, default):
    """hf[k] as an int, `default` when absent, null or 0 (keys the released files may leave null)."""
    return _number(k, hf.get(k) or default)

  _check_supported(hf)
  need("layer_types")
  layer_types = _names(hf, "layer_types", [])
  n_lists = len(layer_types)
  mtp = num("num_nextn_predict_layers", 0)
  L = num("num_hidden_layers")
  if L + mtp != n_lists and L == n_lists:  # some exports count the MTP layers in num_hidden_layers
    L -= mtp
  other = _section(hf, "attention_other_setting")
  kv_heads, heads, hidden = num("num_attention_groups"), num("num_attention_heads"), num("hidden_size")
  top_k, width = num("moe_top_k", 4), num("moe_intermediate_size", 10240)
  max_pos = nullable("max_position_embeddings", nullable("max_seq_len", 262144))

  def per_layer(key, default):
    v = hf.get(key, default)
    v = default if v is None else v
    if isinstance(v, (list, tuple)):
      return [_number(f"{key}[{i}]", x or 0.0, float) for i, x in enumerate(v)]
    return [_number(key, v, float)] * n_lists

  c = model_config(
    vocab_size=num("vocab_size"),
    hidden_size=hidden,
    head_dim=num("head_dim", hidden // max(heads, 1)),  # (num_heads 0: validate names it)
    num_layers=L,
    num_mtp_layers=mtp,
    num_heads=heads,
    num_heads_swa=_number("attention_other_setting.num_attention_heads", other.get("num_attention_heads", heads)),
    num_kv_heads=kv_heads,
    sliding_window=nullable("sliding_window", max_pos),  # null: sliding layers see every earlier token
    layer_types=layer_types,
    rope_theta=per_layer("rope_theta", 10000.0),
    partial_rotary_factors=per_layer("partial_rotary_factors", 1.0),
    rope_scaling=_rope_scaling(hf),
    rope_scaling_layer_types=_names(hf, "yarn_only_types", [FULL]),
    intermediate_size=num("intermediate_size"),
    moe_layers=_moe_layers(hf.get("moe_layers_enum"), L),
    num_experts=num("moe_num_experts", 16),
    num_experts_per_tok=top_k,
    moe_intermediate_size=width,
    shared_expert_intermediate_size=nullable("share_expert_dim", width * top_k),
    routed_scaling_factor=num("moe_router_scaling_factor", 1.0, float),
    norm_expert_weight=bool(hf.get("norm_expert_weight", True)),
    swiglu_limits=per_layer("swiglu_limits", 0.0),
    swiglu_limits_shared=per_layer("swiglu_limits_shared", 0.0),
    rms_norm_eps=num("rms_norm_eps", 1e-5, float),
    max_position_embeddings=max_pos,
  )
  for k, v in _section(hf, "stepflash_jax").items():
    if k in IMPL_KEYS:
      try:
        c[k] = v
      except TypeError:
        raise ValueError(f"config.json: 'stepflash_jax.{k}' must be a {type(c[k]).__name__}, got {v!r}") from None
  validate(c)
  return c


def _moe_layers(v, num_layers: int) -> list:
  """moe_layers_enum: "1,2,..." or a list; absent = layers 1..L-1 (the remote code's default)."""
  if v is None:
    return list(range(1, num_layers))
  if isinstance(v, str):
    v = [int(x) if x.strip().isdigit() else x for x in v.split(",") if x.strip()]
  if not isinstance(v, (list, tuple)):
    raise ValueError(f"config.json: 'moe_layers_enum' must be a list or a comma-separated string, got {v!r}")
  return [_number("moe_layers_enum", x) for x in v]


_ROPE_KEYS = (
  ("factor", float),
  ("original_max_position_embeddings", int),
  ("low_freq_factor", float),
  ("high_freq_factor", float),
)


def _rope_scaling(hf: dict) -> dict | None:
  """config.json's rope_scaling (llama3 keys) as model_config takes it; absent, null or rope_type "default" = no
  scaling (the reference's ROPE_INIT_FUNCTIONS["default"]); other types are not implemented."""
  s = _section(hf, "rope_scaling")
  rope_type = s.get("rope_type", s.get("type", "llama3"))
  if not s or rope_type == "default":
    return None
  if rope_type != "llama3":
    raise ValueError(f"config.json: 'rope_scaling.rope_type' = {rope_type!r} is not supported (llama3 or default)")
  return dict(rope_type=rope_type, **{k: _number(f"rope_scaling.{k}", s.get(k), cast) for k, cast in _ROPE_KEYS})


IMPL_KEYS = ("dtype", "attention_impl", "moe_impl", "scan_layers", "remat", "expert_parallel", "context_full")


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
    "stepflash_jax": {k: c[k] for k in IMPL_KEYS if k in c},
  }
