"""Model components against straightforward references, and whole-model properties (scan, packing, grads)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stepflash_jax as sfj
from stepflash_jax import config as C
from stepflash_jax import model as M
from stepflash_jax.model.mlp import clamped_swiglu
from stepflash_jax.model.moe import route
from stepflash_jax.model.norms import rms_norm
from stepflash_jax.model.rope import apply_rope
import hf_reference


def test_zero_centred_rms_norm():
  x = np.random.RandomState(0).randn(3, 8).astype(np.float32)
  w = np.random.RandomState(1).randn(8).astype(np.float32)
  want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * (1 + w)
  np.testing.assert_allclose(rms_norm(jnp.asarray(x, jnp.bfloat16), w, 1e-5), want, rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(rms_norm(x, w, 1e-5), want, rtol=1e-5)
  np.testing.assert_allclose(rms_norm(x, np.zeros(8), 1e-5), want / (1 + w), rtol=1e-5)  # w = 0 is identity scale
  assert rms_norm(jnp.asarray(x, jnp.bfloat16), w, 1e-5).dtype == jnp.float32


def test_llama3_scaling_regimes_match_reference():
  scaling = dict(factor=2.0, original_max_position_embeddings=131072, low_freq_factor=1.0, high_freq_factor=32.0)
  got = C.rope_inv_freq(128, 0.5, 5e6, scaling)
  want = hf_reference._inv_freq(128, 0.5, 5e6, scaling)
  assert got.shape == (32,)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  plain = C.rope_inv_freq(128, 0.5, 5e6, None)
  assert got[0] == plain[0] and math.isclose(got[-1], plain[-1] / 2)  # high freq kept, low freq / factor
  np.testing.assert_allclose(C.rope_inv_freq(128, 1.0, 1e4, None), 1e4 ** -(np.arange(0, 128, 2) / 128))


def test_partial_rope_rotates_first_dims_only_and_is_relative():
  inv = C.rope_inv_freq(16, 0.5, 1e4, None)  # 8 rotated dims
  rs = np.random.RandomState(0)
  q, k = rs.randn(1, 1, 1, 16).astype(np.float32), rs.randn(1, 1, 1, 16).astype(np.float32)
  pos = lambda p: jnp.full((1, 1), p, jnp.int32)
  rq = apply_rope(q, pos(5), inv)
  np.testing.assert_array_equal(rq[..., 8:], q[..., 8:])
  np.testing.assert_allclose(np.linalg.norm(rq), np.linalg.norm(q), rtol=1e-5)
  d1 = float(jnp.sum(apply_rope(q, pos(7), inv) * apply_rope(k, pos(3), inv)))
  d2 = float(jnp.sum(apply_rope(q, pos(14), inv) * apply_rope(k, pos(10), inv)))
  assert math.isclose(d1, d2, rel_tol=1e-4)


def test_router_bias_changes_selection_not_weights():
  rs = np.random.RandomState(0)
  x, wr = rs.randn(5, 16).astype(np.float32), rs.randn(16, 8).astype(np.float32)
  s = 1 / (1 + np.exp(-(x @ wr)))
  bias = np.zeros(8, np.float32)
  bias[3] = 10.0  # expert 3 always selected, but weighted by its raw score
  scores, chosen, w = route(x, wr, bias, 2, 3.0)
  np.testing.assert_allclose(scores, s, rtol=1e-5)
  assert (np.asarray(chosen) == 3).any(-1).all()
  for t in range(5):
    c = np.asarray(chosen[t])
    np.testing.assert_allclose(w[t], s[t, c] / s[t, c].sum() * 3.0, rtol=1e-5)
    other = [e for e in np.argsort(-s[t]) if e != 3][0]
    assert set(c) == {3, other}


def test_clamped_swiglu():
  g = np.array([-3.0, 0.5, 20.0], np.float32)
  u = np.array([-30.0, 2.0, 9.0], np.float32)
  silu = g / (1 + np.exp(-g))
  np.testing.assert_allclose(clamped_swiglu(g, u, 7.0), np.minimum(silu, 7) * np.clip(u, -7, 7), rtol=1e-6)
  np.testing.assert_allclose(clamped_swiglu(g, u, 0.0), silu * u, rtol=1e-6)
  np.testing.assert_allclose(clamped_swiglu(g, u, jnp.float32(0.0)), silu * u, rtol=1e-6)  # traced 0 = no clamp


def _gqa_cfg(tiny_cfg, **kw):
  c = tiny_cfg.copy_and_resolve_references()
  c.update(kw)
  return c


def test_gqa_groups_8_and_12_match_numpy(tmp_path, tiny_cfg):
  """64/96-style head counts: 8 (full) and 12 (SWA) query heads over one KV head, against the NumPy model."""
  L = 3
  cfg = _gqa_cfg(
    tiny_cfg,
    num_layers=L,
    num_mtp_layers=0,
    num_heads=8,
    num_heads_swa=12,
    num_kv_heads=1,
    head_dim=16,
    hidden_size=64,
    sliding_window=8,
    layer_types=["full_attention"] + ["sliding_attention"] * 2,
    rope_theta=[5e6, 1e4, 1e4],
    partial_rotary_factors=[0.5, 1.0, 1.0],
    moe_layers=[2],
    swiglu_limits=[0.0, 0.0, 7.0],
    swiglu_limits_shared=[0.0, 0.0, 16.0],
    scan_layers=False,
  )
  v = sfj.init(cfg, jax.random.key(0))
  v = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape) if x.ndim == 1 else x, v)
  sfj.save_hf_checkpoint(cfg, v, str(tmp_path))
  W = {
    k: np.asarray(x)
    for k, x in __import__("safetensors.numpy", fromlist=["x"]).load_file(str(tmp_path / "model.safetensors")).items()
  }
  hf = json.load(open(tmp_path / "config.json"))
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, size=12)
  ref, _ = hf_reference.forward(W, hf, tokens)
  np.testing.assert_allclose(sfj.forward(cfg, v, tokens[None])[0], ref, rtol=2e-4, atol=2e-4)


@pytest.fixture(scope="module")
def scan_cfg(tiny_cfg):
  c = tiny_cfg.copy_and_resolve_references()
  c.scan_layers = True
  assert C.model_args(c).scan == (2, 4, 2)  # layers 2..9 as 2 blocks of 4
  return c


@pytest.fixture(scope="module")
def tiny_vars(scan_cfg):
  return sfj.init(scan_cfg, jax.random.key(0))


def test_scan_equals_unrolled_and_attention_impls_agree(scan_cfg, tiny_vars, tmp_path):
  sfj.save_hf_checkpoint(scan_cfg, tiny_vars, str(tmp_path))
  cfg_u, v_u = sfj.load_hf_checkpoint(
    str(tmp_path), scan_layers=False, attention_impl="reference", moe_impl="reference"
  )
  assert "blocks" not in v_u["params"] and "layer_5" in v_u["params"]
  tokens = jax.random.randint(jax.random.key(1), (2, 48), 0, scan_cfg.vocab_size)
  np.testing.assert_allclose(
    sfj.forward(scan_cfg, tiny_vars, tokens), sfj.forward(cfg_u, v_u, tokens), rtol=1e-4, atol=1e-4
  )


def test_packed_documents_do_not_interact(scan_cfg, tiny_vars):
  """A packed row (segment ids, restarting positions) gives each document's logits as if run alone."""
  rs = np.random.RandomState(0)
  a, b = rs.randint(1, 512, size=20), rs.randint(1, 512, size=27)
  run = jax.jit(lambda t, p, s: sfj.apply(scan_cfg, tiny_vars, t, positions=p, segment_ids=s)["logits"][0])

  def row(docs, pad_to=50):
    t = np.concatenate(docs + [np.zeros(pad_to - sum(map(len, docs)), int)])
    s = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)] + [np.zeros(pad_to - len(t) + len(t))])
    s = s[:pad_to]
    p = np.concatenate([np.arange(len(d)) for d in docs] + [np.zeros(pad_to - sum(map(len, docs)))])
    return [jnp.asarray(x[None], jnp.int32) for x in (t, p, s)]

  packed = run(*row([a, b]))
  np.testing.assert_allclose(packed[:20], run(*row([a]))[:20], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(packed[20:47], run(*row([b]))[:27], rtol=1e-4, atol=1e-4)


def test_gradients_finite_and_router_bias_untouched(scan_cfg, tiny_vars):
  tiny_cfg = scan_cfg
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, tiny_cfg.vocab_size)

  def loss(params):
    out = sfj.apply(tiny_cfg, {"params": params, "router": tiny_vars["router"]}, tokens, mtp=True)
    lp = jax.nn.log_softmax(out["logits"][:, :-1])
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()
    return nll + sum(jax.nn.logsumexp(m, -1).mean() for m in out["mtp_logits"]) * 0.1

  g = jax.jit(jax.grad(loss))(tiny_vars["params"])
  leaves = jax.tree.leaves(g)
  assert all(bool(jnp.isfinite(x).all()) for x in leaves)
  assert float(jnp.abs(g["blocks"]["sub_0"]["moe"]["gate_proj"]["kernel"]).sum()) > 0  # experts get gradients
  assert float(jnp.abs(g["mtp_2"]["head"]["kernel"]).sum()) > 0


def test_moe_stats_and_bias_collection(scan_cfg, tiny_vars):
  tiny_cfg = scan_cfg
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, tiny_cfg.vocab_size)
  _, st = jax.jit(lambda v, t: sfj.apply(tiny_cfg, v, t, stats=True))(tiny_vars, tokens)
  load = st["blocks"]["sub_0"]["moe"]["load"][0]  # [n_blocks, E]
  assert load.shape == (2, tiny_cfg.num_experts)
  np.testing.assert_allclose(load.sum(-1), 2 * 16 * tiny_cfg.num_experts_per_tok)
  conf = st["blocks"]["sub_0"]["moe"]["confidence"][0]
  assert bool(jnp.all((conf > 0) & (conf <= 1)))
  assert jax.tree.structure(tiny_vars["router"]) != jax.tree.structure(tiny_vars["params"])


def test_count_params_full_model():
  from experiments.count_params import count

  c = count(sfj.model_config())
  assert abs(c["total"] / 195.9e9 - 1) < 0.005
  assert abs(c["total_with_embeddings"] / 196.96e9 - 1) < 0.005
  assert abs(c["active"] / 10.93e9 - 1) < 0.005
  assert abs(c["mtp"] / 0.84e9 - 1) < 0.01


def test_bad_token_ids_and_empty_input_raise(tiny_cfg):
  """Out-of-range ids (NaN logits / silent wrap-around otherwise) and T = 0 raise a clear ValueError."""
  v = sfj.init(tiny_cfg, jax.random.key(0))
  V = tiny_cfg.vocab_size
  with pytest.raises(ValueError, match=rf"forward: token ids must lie in \[0, {V}\).*got ids in \[1, {V + 4}\]"):
    sfj.forward(tiny_cfg, v, np.array([[1, V, V + 4]], np.int32))
  with pytest.raises(ValueError, match=r"got ids in \[-3, 2\] \(1 of 2 out of range\)"):
    sfj.forward(tiny_cfg, v, np.array([[-3, 2]], np.int32))
  with pytest.raises(ValueError, match=rf"apply: token ids must lie in \[0, {V}\)"):
    sfj.apply(tiny_cfg, v, jnp.array([[0, V]], jnp.int32))
  for fn in (sfj.forward, lambda c, v, t: sfj.apply(c, v, t)):
    with pytest.raises(ValueError, match=r"empty input, tokens shape \(2, 0\)"):
      fn(tiny_cfg, v, np.zeros((2, 0), np.int32))


def test_config_validation_names_the_field(tiny_cfg):
  for field, value in [("num_experts_per_tok", 99), ("sliding_window", 0), ("attention_impl", "cuda")]:
    c = tiny_cfg.copy_and_resolve_references()
    c[field] = value
    with pytest.raises(ValueError, match=field):
      C.validate(c)
  c = tiny_cfg.copy_and_resolve_references()
  c.layer_types = c.layer_types[:-1]
  with pytest.raises(ValueError, match="layer_types"):
    C.validate(c)


def test_muon_assignment_pinned_for_tiny_and_full():
  """Which parameter Muon / AdamW optimise, from abstract shapes of the real model trees (no weights)."""
  from stepflash_jax.optim import assignment_summary

  full = assignment_summary(M.abstract_variables(sfj.model_config())["params"])
  assert full["blocks/sub_0/moe/gate_proj/kernel"] == "muon batch=(10, 288) matrix=(4096, 1280)"
  assert full["blocks/sub_0/moe/down_proj/kernel"] == "muon batch=(10, 288) matrix=(1280, 4096)"
  assert full["blocks/sub_0/moe/router/kernel"] == "muon batch=(10,) matrix=(4096, 288)"
  assert full["blocks/sub_1/attn/q_proj/kernel"] == "muon batch=(10,) matrix=(4096, 8192)"  # layer 4: full, 64 heads
  assert full["blocks/sub_0/attn/q_proj/kernel"] == "muon batch=(10,) matrix=(4096, 12288)"  # SWA, 96 heads
  assert full["blocks/sub_0/attn/o_proj/kernel"] == "muon batch=(10,) matrix=(12288, 4096)"
  assert full["layer_0/mlp/gate_proj/kernel"] == "muon batch=() matrix=(4096, 11264)"
  assert full["mtp_0/eh_proj/kernel"] == "muon batch=() matrix=(8192, 4096)"
  adamw = sorted(k for k, v in full.items() if v.startswith("adamw"))
  assert {"embed/embedding", "lm_head/kernel", "mtp_0/head/kernel", "mtp_2/head/kernel"} <= set(adamw)
  assert all(
    k.endswith("scale") or k in ("embed/embedding", "lm_head/kernel") or k.endswith("head/kernel") for k in adamw
  )
  tiny = assignment_summary(
    M.abstract_variables(
      C.load_config_file(os.path.join(os.path.dirname(__file__), "..", "configs", "model", "tiny.py"))
    )["params"]
  )
  assert tiny["layer_2/moe/up_proj/kernel"] == "muon batch=(8,) matrix=(128, 64)"
  assert tiny["layer_4/attn/k_proj/kernel"] == "muon batch=() matrix=(128, 64)"
  assert tiny["layer_9/moe/shared/down_proj/kernel"] == "muon batch=() matrix=(64, 128)"
  assert tiny["mtp_1/layer/input_norm/scale"].startswith("adamw")


def test_attention_over_the_written_cache_equals_attention_over_the_old_one():
  """Attention.__call__ reads the keys from the cache after the write (model/attention.py): a ring buffer of
  S = window slots, one decode token per row at per-row columns, so each write evicts the entry one window back,
  which the new query no longer sees. Same output as over the old cache followed by the new token (the keys in
  another order: equal to float rounding); the cache keeps k as [B, Hkv, S, D] and v as [B, Hkv, D, S]."""
  from stepflash_jax.model.attention import cached_attention, write_cache

  rs = np.random.RandomState(0)
  b, S, hkv, hq, d, window = 4, 8, 2, 4, 16, 8
  col = np.array([11, 8, 20, 9], np.int32)  # each row's new column (>= S: the ring is full and wraps)
  old_cols = col[:, None] - S + (np.arange(S)[None] - (col[:, None] - S)) % S  # the column each slot holds
  cache = {
    "k": jnp.asarray(rs.randn(b, hkv, S, d), jnp.float32),
    "v": jnp.asarray(rs.randn(b, hkv, d, S), jnp.float32),
    "pos": jnp.asarray(old_cols, jnp.int32),
  }
  k, v, q = (jnp.asarray(rs.randn(b, 1, h, d), jnp.float32) for h in (hkv, hkv, hq))
  pos = jnp.asarray(col[:, None])
  written = write_cache(cache, k, v, pos, jnp.asarray(col))
  rows, slot = np.arange(b), col % S
  np.testing.assert_array_equal(np.asarray(written["pos"])[rows, slot], col)
  np.testing.assert_array_equal(np.asarray(written["k"])[rows, :, slot], np.asarray(k)[:, 0])
  np.testing.assert_array_equal(np.asarray(written["v"])[rows, :, :, slot], np.asarray(v)[:, 0])
  # one scalar start column for all rows writes the same slots as per-row columns that are all equal
  same = write_cache(cache, k, v, pos, jnp.asarray(np.full(b, 13, np.int32)))
  for key, x in write_cache(cache, k, v, pos, 13).items():
    np.testing.assert_array_equal(np.asarray(x), np.asarray(same[key]))

  def over_old(w):  # the old cache, then the new token
    return cached_attention(
      q,
      jnp.concatenate([cache["k"], jnp.swapaxes(k, 1, 2)], 2),
      jnp.concatenate([cache["v"], jnp.transpose(v, (0, 2, 3, 1))], 3),
      pos,
      jnp.concatenate([cache["pos"], pos], 1),
      w,
    )

  new = cached_attention(q, written["k"], written["v"], pos, written["pos"], window)
  np.testing.assert_allclose(np.asarray(new), np.asarray(over_old(window)), rtol=1e-6, atol=1e-6)
  # the evicted entry was one window back: were it visible, the two would differ
  assert np.abs(np.asarray(over_old(window + 1)) - np.asarray(new)).max() > 1e-3
