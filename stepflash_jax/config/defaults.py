"""The model ConfigDict and its defaults: the released Step 3.5 Flash (196B) values (docs/architecture.md).

Per-layer lists have one entry per decoder layer *and* per MTP module (45 + 3 = 48 for the full model), so
`layer_types[num_layers + k]` describes MTP module k.
"""

from __future__ import annotations

import ml_collections

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
      # Full-attention layers when the sequence is split over mesh.context (parallel/context.py): "ring" (K/V
      # blocks around the ring, online softmax) | "all_gather" (all K/V at once). SWA layers always exchange a halo.
      context_full="ring",
      moe_impl="xla",  # "reference" | "xla" | "pallas" (ops.grouped_matmul)
      scan_layers=True,  # compile the repeating 4-layer block once (nn.scan)
      remat=False,  # rematerialise each scanned block in the backward pass
      # Expert parallelism under parallel.use_mesh: "none" (GSPMD decides) | "auto" | "gather" | "a2a" | "ragged",
      # optionally ":<capacity factor>" (see stepflash_jax/model/moe_parallel.py). No effect on one device.
      expert_parallel="none",
      # A Hugging Face-layout checkpoint directory to start from (config.json + safetensors + tokenizer): its
      # architecture replaces the fields above, the switches above stay the config's (hf.resolve_model).
      hf_dir="",
    )
  )
  return override(c, overrides)


def override(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """c with `overrides` set (in place); a name c does not have is a ValueError (a typo such as scan_layer=False
  would otherwise be kept and ignored). None is set on its own: update() would merge rope_scaling=None (no
  scaling) into the default dict."""
  unknown = sorted(set(overrides) - set(c.keys()))
  if unknown:
    raise ValueError(
      f"model config has no field '{unknown[0]}'" + (f" (+{len(unknown) - 1} more)" if unknown[1:] else "")
    )
  for k, v in overrides.items():
    if v is None:
      c[k] = None
    else:
      c.update({k: v})  # a dict updates the fields it names (rope_scaling=dict(factor=4.0))
  return c
