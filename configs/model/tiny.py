"""The Step 3.5 Flash architecture scaled for a 2-core CPU (the model of every toy run and test).

Same pattern as the published model: a leading full-attention layer, then 3 SWA + 1 full, dense FFN in the first
layers and MoE after, 64/96-style unequal query heads (4 full / 6 SWA) over 2 KV heads, partial rotary + llama3
scaling on full layers, clamps on the last two layers, MTP-3.
  python experiments/count_params.py --config=configs/model/tiny.py     # ~1 s
`get_config("small")` (the `:small` mode of every run config) is the same model cut to 4 layers + 1 MTP module.
"""

from stepflash_jax.config import FULL, SWA, model_config


PER_LAYER = ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared")


def micro_model(model, num_layers: int = 4, num_mtp_layers: int = 1):
  """The model cut to its first `num_layers` layers (full, SWA, dense, MoE all present) and `num_mtp_layers` MTP
  modules: the same code paths, ~2.5x faster to compile (small runs are dominated by XLA compilation)."""
  L0 = model.num_layers
  m = model.copy_and_resolve_references()
  for f in PER_LAYER:
    v = list(m[f])
    m[f] = v[:num_layers] + v[L0 : L0 + num_mtp_layers]
  m.moe_layers = [i for i in m.moe_layers if i < num_layers]
  m.num_layers, m.num_mtp_layers = num_layers, num_mtp_layers
  return m


def get_config(arg=None):
  if arg not in (None, "", "small"):
    raise ValueError(f"configs/model/tiny.py: unknown variant {arg!r} (use '' or 'small')")
  L, M = 10, 3  # with scan_layers: layers 2..9 = 2 blocks of [SWA, SWA, full, SWA]
  types = [FULL if i % 4 == 0 else SWA for i in range(L + M)]
  model = model_config(
    vocab_size=512,  # matches the locally trained SentencePiece tokenizer
    hidden_size=128,
    head_dim=32,
    num_layers=L,
    num_mtp_layers=M,
    num_heads=4,
    num_heads_swa=6,
    num_kv_heads=2,  # GQA groups of 2 and 3
    sliding_window=32,  # toy sequences are 96-128 tokens: several windows long
    layer_types=types,
    rope_theta=[5e6 if t == FULL else 1e4 for t in types],
    partial_rotary_factors=[0.5 if t == FULL else 1.0 for t in types],
    # Scaling kicks in beyond `original` positions: keep it active at toy lengths so the path is exercised.
    rope_scaling=dict(
      rope_type="llama3", factor=2.0, original_max_position_embeddings=64, low_freq_factor=1.0, high_freq_factor=4.0
    ),
    intermediate_size=256,
    moe_layers=list(range(2, L)),
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    routed_scaling_factor=3.0,
    swiglu_limits=[7.0 if i in (L - 2, L - 1) else 0.0 for i in range(L + M)],
    swiglu_limits_shared=[16.0 if i == L - 1 else 0.0 for i in range(L + M)],
    max_position_embeddings=4096,
    # On XLA:CPU the unrolled 10-layer model trains ~1.7x faster than the scanned one (2 blocks do not amortise
    # the loop); the full config scans. Tests check that both give the same logits.
    scan_layers=False,
  )
  return micro_model(model) if arg == "small" else model
