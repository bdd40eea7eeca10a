"""stepflash_jax.optim.muon (StepFun Muon: Polar Express fp16 + AdamW) against NumPy, optax and known numbers."""

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stepflash_jax.optim import (
  MuonDims,
  assignment_summary,
  muon,
  muon_dims,
  orthogonalize,
  orthogonalize_matrices,
  polar_express_coeffs,
)

# Independent copy of the Step 3.5 Flash report's table (rows 1-6 and the "later" row; the first six rows of the
# Polar Express reference list, NoahAmsel/PolarExpress polar_express/basic.py, and of StepFun's SteptronOss).
# Do not import from the module under test.
TABLE = [
  (8.28721201814563, -23.595886519098837, 17.300387312530933),
  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
  (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
]
LATER = (1.875, -1.25, 0.375)


def np_coeffs(steps):
  """The report's schedule: safety 1.01 on each of the six listed rows; LATER, unscaled, repeats after them."""
  ref = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in TABLE] + [LATER]
  return ref[:steps] + [LATER] * (steps - len(ref))


def np_polar_express(g, steps=6):
  """Float64 NumPy reference of StepFun's orthogonaliser for one 2-D matrix."""
  x = np.asarray(g, np.float64)
  t = x.shape[0] > x.shape[1]
  if t:
    x = x.T
  x = x / (np.linalg.norm(x) * 1.01 + 1e-7)
  for a, b, c in np_coeffs(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if t else x


def svals(o):
  return np.linalg.svd(np.asarray(o, np.float64), compute_uv=False)


def known_spectrum(rng, m, n, kappa):
  """m x n matrix with singular values geomspace(1, 1/kappa)."""
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return ((u * np.geomspace(1.0, 1.0 / kappa, k)) @ v.T).astype(np.float32)


# ---------------------------------------------------------------- orthogonalisation
@pytest.mark.parametrize("steps", [1, 5, 6, 7, 8, 10])
def test_coefficient_schedule_matches_reference(steps):
  """Default: the reference code's schedule (all 6 configured steps divided by the safety factor)."""
  got = polar_express_coeffs(steps)
  assert len(got) == steps
  for g, want in zip(got, np_coeffs(steps)):
    assert g == pytest.approx(want, rel=1e-15)
  if steps == 6:
    assert got[5] == pytest.approx(tuple(v / 1.01**p for v, p in zip(TABLE[5], (1, 3, 5))), rel=1e-15)
    kw = dict(method="polar_express", ns_steps=6, ortho_dtype="float32")
    g = jnp.asarray(np.random.default_rng(0).standard_normal((8, 12)), jnp.float32)
    np.testing.assert_allclose(orthogonalize_matrices(g, **kw), np_polar_express(g), atol=2e-5)


def test_coefficient_schedule_last_step_unscaled_switch():
  """The alternative reading (optim.pe_safety = "last_step_unscaled"): the last step run is left unscaled."""
  got = polar_express_coeffs(6, schedule="last_step_unscaled")
  for (a, b, c), (ea, eb, ec) in zip(got[:5], TABLE[:5]):
    assert (a, b, c) == pytest.approx((ea / 1.01, eb / 1.01**3, ec / 1.01**5), rel=1e-15)
  assert got[5] == TABLE[5]
  assert polar_express_coeffs(8, schedule="last_step_unscaled")[7] == LATER
  with pytest.raises(ValueError, match="schedule"):
    polar_express_coeffs(6, schedule="all")
  with pytest.raises(ValueError, match="schedule"):
    muon(0.1, pe_safety="none")


@pytest.mark.parametrize("shape", [(12, 40), (40, 12)])
def test_polar_express_matches_numpy(shape):
  g = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
  got = orthogonalize_matrices(jnp.asarray(g), ortho_dtype="float32")
  np.testing.assert_allclose(np.asarray(got), np_polar_express(g), atol=2e-5)
  one = orthogonalize_matrices(jnp.asarray(g), ns_steps=1, ortho_dtype="float32")  # a single (last) step
  np.testing.assert_allclose(np.asarray(one), np_polar_express(g, steps=1), atol=2e-5)
  assert not np.allclose(np.asarray(got), np.asarray(one), atol=1e-2)


# Measured on these inputs (sigma_min / ||G||_F >= 1e-3): fp32 [0.9983, 1.0012], fp16 [0.9982, 1.0014],
# bf16 [0.9954, 1.0057]. Exact-arithmetic guarantee of the 6-step table for sigma/(1.01||G||_F) in [1e-3, 1/1.01]:
# [0.9956, 1.0012]. Classic NS-5 on the same inputs: [0.68, 1.16].
BANDS = {"float32": (0.99, 1.01), "float16": (0.985, 1.015), "bfloat16": (0.97, 1.03)}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_singular_value_band(dtype):
  rng = np.random.default_rng(2)
  lo, hi = BANDS[dtype]
  for m, n in [(16, 48), (48, 16), (24, 24)]:
    g = np.stack([known_spectrum(rng, m, n, k) for k in (1.0, 10.0, 100.0)])  # batch of 3 matrices
    o = np.asarray(orthogonalize_matrices(jnp.asarray(g), ortho_dtype=dtype))
    for i in range(3):
      s = svals(o[i])
      assert lo <= s.min() and s.max() <= hi, (dtype, m, n, i, s.min(), s.max())
  ns = svals(
    orthogonalize_matrices(
      jnp.asarray(known_spectrum(rng, 16, 48, 10.0)), method="newton_schulz", ortho_dtype="float32"
    )
  )
  assert 0.6 <= ns.min() and ns.max() <= 1.25 and ns.min() < 0.9  # NS-5 is a much looser band


def test_nd_views_are_per_slice_matrices():
  rng = np.random.default_rng(3)
  H, Hq, D, E, F, nb = 8, 3, 4, 3, 6, 2
  kw = dict(ortho_dtype="float32")
  q = rng.standard_normal((H, Hq, D)).astype(np.float32)
  got = orthogonalize(jnp.asarray(q), MuonDims((0,), (1, 2)), **kw)
  np.testing.assert_allclose(np.asarray(got).reshape(H, Hq * D), np_polar_express(q.reshape(H, Hq * D)), atol=3e-5)
  o = rng.standard_normal((Hq, D, H)).astype(np.float32)
  got = orthogonalize(jnp.asarray(o), MuonDims((0, 1), (2,)), **kw)
  np.testing.assert_allclose(np.asarray(got).reshape(Hq * D, H), np_polar_express(o.reshape(Hq * D, H)), atol=3e-5)
  w = rng.standard_normal((nb, E, F, H)).astype(np.float32)  # scanned expert stack
  got = np.asarray(orthogonalize(jnp.asarray(w), MuonDims((2,), (3,)), **kw))
  for b in range(nb):
    for e in range(E):
      np.testing.assert_allclose(got[b, e], np_polar_express(w[b, e]), atol=3e-5)
  # a non-trailing layout: [in, batch, out]
  x = rng.standard_normal((5, 2, 9)).astype(np.float32)
  got = np.asarray(orthogonalize(jnp.asarray(x), MuonDims((0,), (2,)), **kw))
  for i in range(2):
    np.testing.assert_allclose(got[:, i, :], np_polar_express(x[:, i, :]), atol=3e-5)


def test_output_split_orthogonalises_chunks_separately():
  g = np.random.default_rng(4).standard_normal((8, 20)).astype(np.float32)
  got = np.asarray(orthogonalize(jnp.asarray(g), MuonDims((0,), (1,), (12, 8)), rms_scale=0.2, ortho_dtype="float32"))
  np.testing.assert_allclose(got[:, :12], 0.2 * math.sqrt(12) * np_polar_express(g[:, :12]), atol=1e-4)
  np.testing.assert_allclose(got[:, 12:], 0.2 * math.sqrt(8) * np_polar_express(g[:, 12:]), atol=1e-4)


# ---------------------------------------------------------------- the optimiser
def test_known_numbers_muon_scale_weight_decay_and_adamw():
  rng = np.random.default_rng(5)
  m, n, c, lr, wd = 8, 32, 0.37, 0.02, 0.1
  u, _ = np.linalg.qr(rng.standard_normal((m, m)))
  v, _ = np.linalg.qr(rng.standard_normal((n, m)))
  uvt = (u @ v.T).astype(np.float32)  # all singular values of G equal c
  w0 = rng.standard_normal((m, n)).astype(np.float32)
  e0 = rng.standard_normal((6, m)).astype(np.float32)
  ge = rng.standard_normal((6, m)).astype(np.float32)
  params = {
    "mlp": {"up_proj": {"kernel": jnp.asarray(w0)}},
    "embed": {"embedding": jnp.asarray(e0)},
    "final_norm": {"scale": jnp.full((m,), 0.5)},
  }
  grads = {
    "mlp": {"up_proj": {"kernel": jnp.asarray(c * uvt)}},
    "embed": {"embedding": jnp.asarray(ge)},
    "final_norm": {"scale": jnp.full((m,), -3.0)},
  }
  tx = muon(lr, ortho_dtype="float32")
  upd, _ = tx.update(grads, tx.init(params), params)
  # the polynomial acts on the scalar x0 = c / (c sqrt(m) * 1.01 + 1e-7) (Nesterov factor 1.95 cancels)
  x = 1.95 * c / (1.95 * c * math.sqrt(m) * 1.01 + 1e-7)
  for a, b, cc in np_coeffs(6):
    x = a * x + b * x**3 + cc * x**5
  assert abs(x - 1) < 5e-3
  expect = -lr * (0.2 * math.sqrt(max(m, n)) * x * uvt + wd * w0)
  np.testing.assert_allclose(np.asarray(upd["mlp"]["up_proj"]["kernel"]), expect, atol=2e-6)
  # AdamW first step: m_hat = g, v_hat = g^2 -> -lr * (sign(g) + wd * p)
  np.testing.assert_allclose(np.asarray(upd["embed"]["embedding"]), -lr * (np.sign(ge) + wd * e0), atol=1e-6)
  np.testing.assert_allclose(np.asarray(upd["final_norm"]["scale"]), -lr * (-1 + wd * 0.5), atol=1e-7)


def test_multi_step_momentum_schedule_matches_numpy():
  rng = np.random.default_rng(6)
  sched = optax.linear_schedule(0.03, 0.01, 3)
  w = rng.standard_normal((6, 10)).astype(np.float32)
  tx = muon(sched, ortho_dtype="float32")
  params = {"attn": {"g_proj": {"kernel": jnp.asarray(w)}}}
  state = tx.init(params)
  step = jax.jit(tx.update)
  ref_w, buf = w.astype(np.float64), np.zeros_like(w, np.float64)
  for t in range(3):
    g = rng.standard_normal(w.shape).astype(np.float32)
    upd, state = step({"attn": {"g_proj": {"kernel": jnp.asarray(g)}}}, state, params)
    params = optax.apply_updates(params, upd)
    lr = 0.03 - 0.02 * t / 3
    buf = 0.95 * buf + g
    o = np_polar_express(g + 0.95 * buf)
    ref_w = ref_w * (1 - lr * 0.1) - lr * 0.2 * math.sqrt(10) * o
    np.testing.assert_allclose(np.asarray(params["attn"]["g_proj"]["kernel"]), ref_w, atol=5e-6)


@pytest.mark.parametrize(
  "path,shape,expert_axis",
  [
    (("moe", "gate_proj", "kernel"), (3, 8, 12), 0),
    (("blocks", "sub_0", "moe", "down_proj", "kernel"), (2, 3, 12, 8), 1),
  ],
)
def test_experts_do_not_influence_each_other(path, shape, expert_axis):
  rng = np.random.default_rng(7)

  def tree(x):
    d = x
    for k in reversed(path):
      d = {k: d}
    return d

  def leaf(t):
    for k in path:
      t = t[k]
    return np.asarray(t)

  p = tree(jnp.asarray(rng.standard_normal(shape), jnp.float32))
  g = rng.standard_normal(shape).astype(np.float32)
  tx = muon(1e-2)
  s0 = tx.init(p)
  u1 = leaf(jax.jit(tx.update)(tree(jnp.asarray(g)), s0, p)[0])
  g2 = g.copy()
  idx = (slice(None),) * expert_axis + (0,)
  g2[idx] += 5.0 * rng.standard_normal(g2[idx].shape).astype(np.float32)
  u2 = leaf(jax.jit(tx.update)(tree(jnp.asarray(g2)), s0, p)[0])
  assert np.abs(u1[idx] - u2[idx]).max() > 1e-4  # expert 0 changed
  rest = (slice(None),) * expert_axis + (slice(1, None),)
  np.testing.assert_array_equal(u1[rest], u2[rest])  # experts 1.. bit-identical


def test_matches_optax_contrib_muon_with_newton_schulz():
  from optax.contrib import MuonDimensionNumbers as MDN

  rng = np.random.default_rng(8)
  shapes = {"w": (16, 24), "e": (3, 8, 12), "o": (2, 4, 16)}
  params = {
    "mlp": {"down_proj": {"kernel": None}},
    "moe": {"gate_proj": {"kernel": None}},
    "attn": {"o_proj": {"kernel": None}},
  }
  arrays = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
  grads_ = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
  build = lambda d: {
    "mlp": {"down_proj": {"kernel": d["w"]}},
    "moe": {"gate_proj": {"kernel": d["e"]}},
    "attn": {"o_proj": {"kernel": d["o"]}},
  }
  params, grads = build(arrays), build(grads_)
  dims = build({"w": MDN(0, 1), "e": MDN(1, 2), "o": MDN((0, 1), 2)})
  ref = optax.contrib.muon(
    0.05,
    ns_coeffs=(3.4445, -4.7750, 2.0315),
    ns_steps=5,
    beta=0.95,
    eps=1e-8,
    weight_decay=0.1,
    nesterov=True,
    muon_weight_dimension_numbers=dims,
    consistent_rms=0.2,
  )
  ours = muon(0.05, method="newton_schulz", ortho_dtype="float32", norm_safety=1.0, eps=1e-8)
  u_ref, _ = ref.update(grads, ref.init(params), params)
  u_ours, _ = ours.update(grads, ours.init(params), params)
  for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- assignment
def contract_tree(V=32, H=8, D=4, Hq=4, Hkv=2, I=12, E=3, F=6, S=6, nb=2):
  z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

  def layer(moe, lead=()):
    t = {
      "input_norm": {"scale": z(*lead, H)},
      "post_attn_norm": {"scale": z(*lead, H)},
      "attn": {
        "q_proj": {"kernel": z(*lead, H, Hq, D)},
        "k_proj": {"kernel": z(*lead, H, Hkv, D)},
        "v_proj": {"kernel": z(*lead, H, Hkv, D)},
        "g_proj": {"kernel": z(*lead, H, Hq)},
        "o_proj": {"kernel": z(*lead, Hq, D, H)},
        "q_norm": {"scale": z(*lead, D)},
        "k_norm": {"scale": z(*lead, D)},
      },
    }
    if moe:
      t["moe"] = {
        "router": {"kernel": z(*lead, H, E)},
        "gate_proj": {"kernel": z(*lead, E, H, F)},
        "up_proj": {"kernel": z(*lead, E, H, F)},
        "down_proj": {"kernel": z(*lead, E, F, H)},
        "shared": {
          "gate_proj": {"kernel": z(*lead, H, S)},
          "up_proj": {"kernel": z(*lead, H, S)},
          "down_proj": {"kernel": z(*lead, S, H)},
        },
      }
    else:
      t["mlp"] = {
        "gate_proj": {"kernel": z(*lead, H, I)},
        "up_proj": {"kernel": z(*lead, H, I)},
        "down_proj": {"kernel": z(*lead, I, H)},
      }
    return t

  return {
    "params": {
      "embed": {"embedding": z(V, H)},
      "layer_0": layer(False),
      "blocks": {"sub_0": layer(True, (nb,))},
      "final_norm": {"scale": z(H)},
      "lm_head": {"kernel": z(H, V)},
      "mtp_0": {
        "enorm": {"scale": z(H)},
        "hnorm": {"scale": z(H)},
        "eh_proj": {"kernel": z(2 * H, H)},
        "layer": layer(False),
        "final_norm": {"scale": z(H)},
        "head": {"kernel": z(H, V)},
      },
    }
  }


def test_assignment_on_contract_tree():
  variables = contract_tree()
  s = assignment_summary(variables["params"])
  adamw = {k for k, v in s.items() if v.startswith("adamw")}
  assert adamw == {
    "embed/embedding",
    "lm_head/kernel",
    "mtp_0/head/kernel",
    "final_norm/scale",
    "mtp_0/final_norm/scale",
    "mtp_0/enorm/scale",
    "mtp_0/hnorm/scale",
  } | {
    f"{pre}/{n}"
    for pre in ("layer_0", "blocks/sub_0", "mtp_0/layer")
    for n in ("input_norm/scale", "post_attn_norm/scale", "attn/q_norm/scale", "attn/k_norm/scale")
  }
  assert s["layer_0/attn/q_proj/kernel"] == "muon batch=() matrix=(8, 16)"
  assert s["layer_0/attn/k_proj/kernel"] == "muon batch=() matrix=(8, 8)"
  assert s["layer_0/attn/o_proj/kernel"] == "muon batch=() matrix=(16, 8)"
  assert s["layer_0/attn/g_proj/kernel"] == "muon batch=() matrix=(8, 4)"
  assert s["layer_0/mlp/down_proj/kernel"] == "muon batch=() matrix=(12, 8)"
  assert s["mtp_0/eh_proj/kernel"] == "muon batch=() matrix=(16, 8)"
  assert s["mtp_0/layer/attn/o_proj/kernel"] == "muon batch=() matrix=(16, 8)"
  assert s["blocks/sub_0/attn/q_proj/kernel"] == "muon batch=(2,) matrix=(8, 16)"
  assert s["blocks/sub_0/moe/router/kernel"] == "muon batch=(2,) matrix=(8, 3)"
  assert s["blocks/sub_0/moe/gate_proj/kernel"] == "muon batch=(2, 3) matrix=(8, 6)"
  assert s["blocks/sub_0/moe/down_proj/kernel"] == "muon batch=(2, 3) matrix=(6, 8)"
  assert s["blocks/sub_0/moe/shared/down_proj/kernel"] == "muon batch=(2,) matrix=(6, 8)"
  # the raw dims, and the same tree with the "params" root, and an unrolled MoE layer
  d = muon_dims(variables)["params"]
  assert d["blocks"]["sub_0"]["attn"]["o_proj"]["kernel"] == MuonDims((1, 2), (3,))
  assert d["blocks"]["sub_0"]["moe"]["up_proj"]["kernel"] == MuonDims((2,), (3,))
  assert d["embed"]["embedding"] is None
  flat = muon_dims({"layer_3": {"moe": {"down_proj": {"kernel": jax.ShapeDtypeStruct((3, 6, 8), jnp.float32)}}}})
  assert flat["layer_3"]["moe"]["down_proj"]["kernel"] == MuonDims((1,), (2,))
  with pytest.raises(ValueError, match="layer_0/mystery/kernel.*\\(2, 3, 4\\)"):
    muon_dims({"layer_0": {"mystery": {"kernel": jnp.zeros((2, 3, 4))}}})


def test_jit_state_dtypes_bf16_params_and_orbax_roundtrip(tmp_path):
  import orbax.checkpoint as ocp

  full = contract_tree()["params"]
  small = {
    "embed": full["embed"],
    "final_norm": full["final_norm"],
    "layer_0": {"attn": full["layer_0"]["attn"]},
    "blocks": {"sub_0": {"moe": {k: full["blocks"]["sub_0"]["moe"][k] for k in ("router", "down_proj")}}},
  }
  tree = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, jnp.bfloat16), small)
  tx = muon(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10), grad_clip_norm=1.0)
  state = jax.jit(tx.init)(tree)
  leaves = jax.tree.leaves(state)
  assert all(isinstance(x, jax.Array) for x in leaves)
  float_leaves = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
  assert float_leaves and all(x.dtype == jnp.float32 for x in float_leaves)  # momenta / moments fp32
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, tree)
  step = jax.jit(tx.update)
  upd, state = step(grads, state, tree)
  assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(upd))  # warmup: lr(0) = 0
  upd, state = step(grads, state, tree)
  for u, p in zip(jax.tree.leaves(upd), jax.tree.leaves(tree)):
    assert u.shape == p.shape and u.dtype == p.dtype
    assert bool(jnp.all(jnp.isfinite(u.astype(jnp.float32)))) and float(jnp.abs(u).max()) > 0
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "opt", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "opt", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_inputs():
  with pytest.raises(ValueError, match="method"):
    muon(1e-3, method="adam")
  with pytest.raises(ValueError, match="ortho_dtype"):
    muon(1e-3, ortho_dtype="float8")
  with pytest.raises(ValueError, match=r"\(4, 5\)"):
    orthogonalize(jnp.zeros((4, 5)), MuonDims((0,), (0,)))
  with pytest.raises(ValueError, match=r"\(4,\)"):
    orthogonalize_matrices(jnp.zeros((4,)))


_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from stepflash_jax.optim import muon
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    expert = ({"blocks": {"sub_0": {"moe": {"down_proj": {"kernel": arr(2, 4, 6, 8)}}}},
               "moe": {"gate_proj": {"kernel": arr(4, 8, 6)}}},
              {"blocks": {"sub_0": {"moe": {"down_proj": {"kernel": P(None, "x")}}}},
               "moe": {"gate_proj": {"kernel": P("x")}}})
    tensor = ({"attn": {"q_proj": {"kernel": arr(8, 4, 6)}, "o_proj": {"kernel": arr(4, 6, 8)}}},
              {"attn": {"q_proj": {"kernel": P(None, "x")}, "o_proj": {"kernel": P("x")}}})
    cases = ((AxisType.Explicit, "expert"), (AxisType.Explicit, "tensor"), (AxisType.Auto, "expert"))
    for axis_type, name in cases:   # (Auto + tensor-parallel is plain GSPMD; Explicit needs the reshard path)
        mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
        p, spec = {"expert": expert, "tensor": tensor}[name]
        with jax.set_mesh(mesh):
            sh = jax.tree.map(lambda s: NamedSharding(mesh, s), spec)
            tx = muon(1e-2)
            g = jax.tree.map(lambda x: x * 0.5 + 1.0, p)
            ps, gs = jax.device_put(p, sh), jax.device_put(g, sh)
            state = jax.jit(tx.init)(ps)
            f = jax.jit(tx.update)
            if name == "expert":      # expert axis sharded: every matrix is local, no communication at all
                hlo = f.lower(gs, state, ps).compile().as_text()
                for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
                    assert op not in hlo, (axis_type, op)
            u, _ = f(gs, state, ps)
            ref, _ = jax.jit(tx.update)(g, tx.init(p), p)
            for a, b, s in zip(jax.tree.leaves(u), jax.tree.leaves(ref), jax.tree.leaves(sh)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
                assert a.sharding.is_equivalent_to(s, a.ndim), (axis_type, name, a.sharding, s)
    print("SHARDED_OK")
""")


def test_sharded_expert_axis_needs_no_collectives():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, env=env, timeout=120)
  assert "SHARDED_OK" in r.stdout, r.stdout + r.stderr
