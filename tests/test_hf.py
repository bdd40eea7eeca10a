"""HF-layout checkpoints: exact round trip, errors naming bad tensors, and logits vs an independent NumPy model."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import stepflash_jax as sfj
import hf_reference


def randomized(cfg, seed=0):
  """Random variables with non-zero norm weights and router biases, so every convention is exercised."""
  v = sfj.init(cfg, jax.random.key(seed))
  rs = np.random.RandomState(seed)
  noisy = lambda x: x.ndim == 1 or x.shape[-1] == cfg.num_experts  # norm weights and router biases
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + (0.2 * rs.randn(*x.shape) if noisy(x) else 0), x.dtype), v)


@pytest.fixture(scope="module")
def ckpt(tiny_cfg, tmp_path_factory):
  v = randomized(tiny_cfg)
  path = str(tmp_path_factory.mktemp("hf"))
  sfj.save_hf_checkpoint(tiny_cfg, v, path)
  return v, path


def test_round_trip_exact_and_same_logits(tiny_cfg, ckpt, tmp_path):
  v, path = ckpt
  cfg2, v2 = sfj.load_hf_checkpoint(path)
  assert jax.tree.structure(v) == jax.tree.structure(v2)
  for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(v2)):
    assert a.dtype == b.dtype and a.shape == b.shape and bool(jnp.all(a == b))
  tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, tiny_cfg.vocab_size)
  np.testing.assert_array_equal(sfj.forward(tiny_cfg, v, tokens), sfj.forward(cfg2, v2, tokens))
  # Sharded save (index.json) loads to the same variables.
  sfj.save_hf_checkpoint(cfg2, v2, str(tmp_path), max_shard_bytes=200_000)
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  _, v3 = sfj.load_hf_checkpoint(str(tmp_path))
  for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(v3)):
    assert bool(jnp.all(a == b))


def test_overrides_name_unknown_fields(ckpt):
  """A misspelt override is an error naming it, in model_config and in load_hf_checkpoint, not a field kept and
  ignored; rope_scaling=None switches the scaling off."""
  with pytest.raises(ValueError, match="model config has no field 'scan_layer'"):
    sfj.model_config(scan_layer=False)
  with pytest.raises(ValueError, match=r"no field 'moe_implementation' \(\+1 more\)"):
    sfj.load_hf_checkpoint(ckpt[1], moe_implementation="xla", remat_policy="none")
  assert sfj.model_config(rope_scaling=None).rope_scaling is None
  assert sfj.model_config(rope_scaling=dict(factor=4.0)).rope_scaling.low_freq_factor == 1.0  # the rest kept
  cfg, _ = sfj.load_hf_checkpoint(ckpt[1], scan_layers=False, remat=True)
  assert (cfg.scan_layers, cfg.remat) == (False, True)


def test_logits_match_independent_numpy_model(tiny_cfg, ckpt):
  _, path = ckpt
  cfg, v = sfj.load_hf_checkpoint(path)
  W = load_file(os.path.join(path, "model.safetensors"))
  hf = json.load(open(os.path.join(path, "config.json")))
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, size=40)  # > window 32: the band matters
  ref, ref_mtp = hf_reference.forward(W, hf, tokens)
  out = jax.jit(lambda v, t: sfj.apply(cfg, v, t, mtp=True))(v, jnp.asarray(tokens)[None])
  np.testing.assert_allclose(out["logits"][0], ref, rtol=2e-4, atol=2e-4)
  assert len(out["mtp_logits"]) == 3
  for got, want in zip(out["mtp_logits"], ref_mtp):
    np.testing.assert_allclose(got[0], want, rtol=2e-4, atol=2e-4)


def _rewrite(path, dst, fn):
  W = dict(load_file(os.path.join(path, "model.safetensors")))
  fn(W)
  os.makedirs(dst, exist_ok=True)
  save_file(W, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(path, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
    g.write(f.read())


def test_bad_tensors_are_named(ckpt, tmp_path):
  _, path = ckpt
  name = "model.layers.3.moe.gate_proj.weight"
  _rewrite(path, tmp_path / "missing", lambda W: W.pop(name))
  with pytest.raises(ValueError, match="missing tensor 'model.layers.3.moe.gate_proj.weight'"):
    sfj.load_hf_checkpoint(str(tmp_path / "missing"))
  _rewrite(path, tmp_path / "extra", lambda W: W.update({"model.layers.99.foo.weight": np.zeros(2, np.float32)}))
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.99.foo.weight'"):
    sfj.load_hf_checkpoint(str(tmp_path / "extra"))
  _rewrite(path, tmp_path / "shape", lambda W: W.update({name: W[name][:, :-1]}))
  with pytest.raises(ValueError, match="tensor 'model.layers.3.moe.gate_proj.weight' has shape"):
    sfj.load_hf_checkpoint(str(tmp_path / "shape"))
  _rewrite(path, tmp_path / "int", lambda W: W.update({name: W[name].astype(np.int8)}))
  with pytest.raises(ValueError, match="tensor 'model.layers.3.moe.gate_proj.weight' has dtype int8, expected a float"):
    sfj.load_hf_checkpoint(str(tmp_path / "int"))


def test_mixed_dtypes_load_as_one(ckpt, tmp_path):
  """One tensor stored in float16 among float32 ones: every leaf is the config's param_dtype (float32), that one
  holding its float16 values."""
  v, path = ckpt
  name = "model.layers.0.mlp.down_proj.weight"
  _rewrite(path, tmp_path / "mixed", lambda W: W.update({name: W[name].astype(np.float16)}))
  cfg, v2 = sfj.load_hf_checkpoint(str(tmp_path / "mixed"))
  assert cfg.param_dtype == "float32" and {x.dtype for x in jax.tree.leaves(v2)} == {jnp.dtype(jnp.float32)}
  want = np.asarray(load_file(os.path.join(path, "model.safetensors"))[name]).astype(np.float16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(v2["params"]["layer_0"]["mlp"]["down_proj"]["kernel"]).T, want)


def test_unreadable_files_are_named(ckpt, tmp_path):
  """A truncated safetensors file or a malformed config.json: ValueError naming the file (not the library's bare
  error)."""
  _, path = ckpt
  _rewrite(path, tmp_path / "trunc", lambda W: None)
  st = tmp_path / "trunc" / "model.safetensors"
  st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
  with pytest.raises(ValueError, match=rf"{st}: cannot read the safetensors file .*incomplete"):
    sfj.load_hf_checkpoint(str(tmp_path / "trunc"))
  _rewrite(path, tmp_path / "badjson", lambda W: None)
  cj = tmp_path / "badjson" / "config.json"
  cj.write_text(cj.read_text()[:-20])
  with pytest.raises(ValueError, match=rf"{cj}: malformed JSON"):
    sfj.load_hf_checkpoint(str(tmp_path / "badjson"))
  cj.write_text(json.dumps({"hidden_size": 8}))  # valid JSON, not a model config
  with pytest.raises(ValueError, match=rf"{cj}: not a valid Step 3.5 Flash config"):
    sfj.load_hf_checkpoint(str(tmp_path / "badjson"))


def test_hf_config_keys_parse():
  """The released config.json conventions: 48-entry lists, string moe_layers_enum, attention_other_setting."""
  c = sfj.model_config()
  hf = sfj.to_hf_config(c)
  assert isinstance(hf["moe_layers_enum"], str) and len(hf["layer_types"]) == 48
  assert hf["attention_other_setting"]["num_attention_heads"] == 96 and hf["num_attention_groups"] == 8
  back = sfj.from_hf_config(hf)
  for k in ("num_layers", "num_heads_swa", "moe_layers", "swiglu_limits", "partial_rotary_factors", "rope_theta"):
    assert list(np.atleast_1d(back[k])) == list(np.atleast_1d(c[k])), k
  hf48 = dict(hf, num_hidden_layers=48)  # some exports count the MTP layers too
  assert sfj.from_hf_config(hf48).num_layers == 45


def test_hf_config_missing_keys_mean_what_the_reference_reads():
  """Keys left out or null read as the remote modeling code with vLLM's Step3p5Config reads them; settings this
  model does not implement are errors naming the key."""
  c = sfj.model_config()
  hf = sfj.to_hf_config(c)
  lean = {k: v for k, v in hf.items() if k not in ("moe_layers_enum", "share_expert_dim", "moe_num_experts")}
  lean.update(sliding_window=None, swiglu_limits=[None] * 47 + [7.0])
  back = sfj.from_hf_config(lean)
  assert list(back.moe_layers) == list(range(1, 45))  # every layer but the first
  assert back.shared_expert_intermediate_size == hf["moe_intermediate_size"] * hf["moe_top_k"]  # 1280 * 8
  assert back.num_experts == 16
  assert back.sliding_window == hf["max_position_embeddings"]  # no window
  assert list(back.swiglu_limits) == [0.0] * 47 + [7.0]  # null = no clamp
  other = dict(hf["attention_other_setting"], num_attention_groups=4)
  with pytest.raises(ValueError, match=r"attention_other_setting\.num_attention_groups' = 4"):
    sfj.from_hf_config(dict(hf, attention_other_setting=other))
  for key, value in (("use_moe_router_bias", False), ("use_head_wise_attn_gate", False), ("tie_word_embeddings", True)):
    with pytest.raises(ValueError, match=rf"'{key}' = {value} is not supported"):
      sfj.from_hf_config(dict(hf, **{key: value}))
  with pytest.raises(ValueError, match="use_rope_layers"):
    sfj.from_hf_config(dict(hf, use_rope_layers=[True] * 47 + [False]))
  # a size of the wrong type names its key (256.0 is the integer 256: JSON writers differ)
  assert sfj.from_hf_config(dict(hf, hidden_size=float(hf["hidden_size"]))).hidden_size == hf["hidden_size"]
  bad = [("hidden_size", "4096", "an integer"), ("moe_top_k", 2.5, "an integer"), ("num_hidden_layers", True, "an")]
  nullable = [("sliding_window", "64", "an integer"), ("share_expert_dim", 1.5, "an integer")]
  nullable += [("max_position_embeddings", "262144", "an integer"), ("rope_theta", "1e4", "a number")]
  for key, value, kind in bad + nullable + [("rms_norm_eps", "1e-5", "a number")]:
    with pytest.raises(ValueError, match=rf"config.json: '{key}' must be {kind}.*got {value!r}"):
      sfj.from_hf_config(dict(hf, **{key: value}))
  # and inside lists and nested settings, by the place of the bad entry
  nested = [
    (
      dict(attention_other_setting=dict(hf["attention_other_setting"], num_attention_heads="96")),
      r"setting\.num_attention_heads'",
    ),
    (dict(swiglu_limits=[0.0] * 47 + ["7"]), r"'swiglu_limits\[47\]' must be a number"),
    (dict(moe_layers_enum="1,2,x"), r"'moe_layers_enum' must be an integer, got 'x'"),
    (dict(moe_layers_enum=3), r"'moe_layers_enum' must be a list"),
    (dict(rope_scaling={k: v for k, v in hf["rope_scaling"].items() if k != "factor"}), r"'rope_scaling\.factor'"),
  ]
  for update, message in nested:
    with pytest.raises(ValueError, match=message):
      sfj.from_hf_config(dict(hf, **update))


def test_hf_config_without_rope_scaling_is_plain_rope():
  """rope_scaling absent, null or of rope_type "default" is the reference's unscaled RoPE (ROPE_INIT_FUNCTIONS
  ["default"]): inv_freq = theta^(-2i/rot) on every layer; other rope types and malformed sections name the key."""
  c = sfj.model_config()
  hf = sfj.to_hf_config(c)
  lean = {k: v for k, v in hf.items() if k != "rope_scaling"}
  for cfg in (lean, dict(hf, rope_scaling=None), dict(hf, rope_scaling={"rope_type": "default"})):
    back = sfj.from_hf_config(cfg)
    assert back.rope_scaling is None
    layer = sfj.config.model_args(back).layers[0]  # a full-attention layer: the one llama3 scaling would change
    rot = round(c.head_dim * c.partial_rotary_factors[0])
    np.testing.assert_allclose(layer.inv_freq, c.rope_theta[0] ** -(np.arange(0, rot, 2) / rot), rtol=1e-12)
  scaled = sfj.config.model_args(sfj.from_hf_config(hf)).layers[0].inv_freq
  assert not np.allclose(scaled, layer.inv_freq)  # the released llama3 scaling does change them
  cases = [
    (dict(rope_scaling=dict(hf["rope_scaling"], rope_type="yarn")), r"'rope_scaling.rope_type' = 'yarn' is not"),
    (dict(rope_scaling="llama3"), r"'rope_scaling' must be an object"),
    (dict(attention_other_setting=[96]), r"'attention_other_setting' must be an object"),
    (dict(layer_types=48), r"'layer_types' must be a list of strings"),
    (dict(yarn_only_types="full_attention"), r"'yarn_only_types' must be a list of strings"),
    (dict(stepflash_jax=dict(scan_layers="no")), r"'stepflash_jax.scan_layers' must be a bool, got 'no'"),
  ]
  for update, message in cases:
    with pytest.raises(ValueError, match=message):
      sfj.from_hf_config(dict(hf, **update))


def test_router_stored_in_bf16_loads_as_fp32(ckpt, tmp_path):
  import ml_dtypes

  v, path = ckpt
  name = "model.layers.3.moe.gate.weight"
  _rewrite(path, tmp_path / "bf16", lambda W: W.update({name: W[name].astype(ml_dtypes.bfloat16)}))
  _, v2 = sfj.load_hf_checkpoint(str(tmp_path / "bf16"))
  leaves = {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_leaves_with_path(v2)}
  routers = {k: x for k, x in leaves.items() if "router" in k}
  assert routers and all(x.dtype == jnp.float32 for x in routers.values())
  want = np.asarray(v["params"]["layer_3"]["moe"]["router"]["kernel"]).astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(v2["params"]["layer_3"]["moe"]["router"]["kernel"], want)
