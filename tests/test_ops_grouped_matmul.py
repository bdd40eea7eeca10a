"""ops.grouped_matmul: reference vs a NumPy loop, tiled "xla" vs reference (fwd + dlhs/drhs)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax import ops

gmm_mod = importlib.import_module("stepflash_jax.ops.grouped_matmul")  # ops.grouped_matmul is the function
gmm = jax.jit(ops.grouped_matmul, static_argnames=("implementation", "tile_m"))


def _data(m, k, n, sizes, seed=0, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  lhs = jnp.asarray(r.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(r.standard_normal((len(sizes), k, n)), dtype)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _numpy_gmm(lhs, rhs, sizes):
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, s in enumerate(sizes):
    for r in range(start, start + s):
      out[r] = lhs[r] @ rhs[g]
    start += s
  return out


def test_reference_matches_numpy_loop():
  sizes = [3, 0, 5, 1, 0]
  lhs, rhs, gs = _data(12, 4, 3, sizes, seed=1)  # 9 of 12 rows used
  got = gmm(lhs, rhs, gs, implementation="reference")
  np.testing.assert_allclose(np.asarray(got), _numpy_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[9:]) == 0)


# (M, K, N, group sizes, tile_m)
CASES = [
  (40, 8, 6, [5, 0, 13, 2, 0, 20], 8),  # empty groups, groups straddling tiles, sum == M
  (40, 8, 6, [0, 7, 9, 0, 3, 0], 8),  # sum < M (21 of 40), leading/trailing empty groups
  (37, 5, 7, [37], 4),  # one group, M not a multiple of tm
  (37, 5, 7, [1] * 10 + [0, 20], 16),  # many tiny groups, each padded to a whole tile
  (30, 6, 4, [0, 0, 0], 8),  # everything empty -> all zeros
  (50, 6, 4, [9, 11, 0, 25], None),  # default tile_m
  (20, 6, 4, [4, 6, 10], 1),  # tm = 1
  (20, 6, 4, [4, 6, 3], 64),  # tm > M
]


@pytest.mark.parametrize("m,k,n,sizes,tm", CASES)
def test_xla_matches_reference_fwd_and_grads(m, k, n, sizes, tm):
  lhs, rhs, gs = _data(m, k, n, sizes, seed=m + len(sizes))
  ct = jnp.asarray(np.random.default_rng(5).standard_normal((m, n)), jnp.float32)

  def run(impl):
    def f(lhs, rhs):
      out = ops.grouped_matmul(lhs, rhs, gs, implementation=impl, **({"tile_m": tm} if impl == "xla" else {}))
      return jnp.sum(out * ct), out

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(lhs, rhs)

  (_, out_ref), (dl_ref, dr_ref) = run("reference")
  (_, out_xla), (dl_xla, dr_xla) = run("xla")
  np.testing.assert_allclose(np.asarray(out_ref), _numpy_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out_xla), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dl_xla), np.asarray(dl_ref), rtol=1e-5, atol=1e-5, err_msg="dlhs")
  np.testing.assert_allclose(np.asarray(dr_xla), np.asarray(dr_ref), rtol=1e-5, atol=1e-5, err_msg="drhs")
  used = sum(sizes)
  assert np.all(np.asarray(out_xla[used:]) == 0) and np.all(np.asarray(dl_xla[used:]) == 0)


def test_rows_past_the_sum_are_zero_even_if_garbage():
  lhs, rhs, gs = _data(24, 4, 3, [5, 0, 6], seed=2)
  lhs = lhs.at[11:].set(jnp.nan)  # padding rows from a token-dropping sort may hold anything
  f = jax.jit(lambda r: ops.grouped_matmul(lhs, r, gs, implementation="xla", tile_m=8))
  out, grad_rhs = jax.jit(jax.value_and_grad(lambda r: f(r).sum()))(rhs)
  full = f(rhs)
  assert np.all(np.asarray(full[11:]) == 0) and np.isfinite(float(out))
  assert bool(jnp.all(jnp.isfinite(grad_rhs)))
  np.testing.assert_allclose(np.asarray(full[:11]), _numpy_gmm(lhs[:11], rhs, [5, 0, 6]), rtol=1e-5, atol=1e-5)


def test_group_sizes_traced_under_jit_and_default_is_xla():
  lhs, rhs, _ = _data(32, 4, 5, [0] * 4, seed=3)
  f = jax.jit(lambda gs: ops.grouped_matmul(lhs, rhs, gs))  # one compilation, different group sizes
  for sizes in ([8, 8, 8, 8], [0, 0, 30, 2], [1, 2, 3, 4]):
    np.testing.assert_allclose(
      np.asarray(f(jnp.asarray(sizes, jnp.int32))), _numpy_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5
    )


def test_bf16_inputs():
  lhs, rhs, gs = _data(48, 32, 16, [10, 0, 17, 15], seed=4, dtype=jnp.bfloat16)
  out = gmm(lhs, rhs, gs, implementation="xla", tile_m=16)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out, np.float32),
    _numpy_gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), [10, 0, 17, 15]),
    rtol=2e-2,
    atol=5e-2,
  )
  dl, dr = jax.jit(jax.grad(lambda a, b: gmm(a, b, gs).astype(jnp.float32).sum(), argnums=(0, 1)))(lhs, rhs)
  assert dl.dtype == dr.dtype == jnp.bfloat16


@pytest.mark.parametrize("sizes", [[3, 5] * 8, [1] * 15 + [49]])
def test_padded_tile_bound(sizes):
  # (M + G (tm - 1)) // tm tiles must hold every group padded to whole tiles; [1] * 15 + [49] needs exactly 22.
  m, tm = 64, 8
  lhs, rhs, gs = _data(m, 3, 2, sizes, seed=6)
  got = jax.jit(gmm_mod.tiled_grouped_matmul, static_argnames="tile_m")(lhs, rhs, gs, tile_m=tm)
  np.testing.assert_allclose(np.asarray(got), _numpy_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


def test_take_rows_gradient_is_the_gather_gradient():
  # A partial permutation: output rows 0..5 take rows perm[:6] of a, output rows 6, 7 are zero rows.
  r = np.random.default_rng(9)
  a = jnp.asarray(r.standard_normal((7, 3)), jnp.float32)
  perm = r.permutation(7)
  idx = jnp.asarray(np.concatenate([perm[:6], [7, 7]]), jnp.int32)
  inv = np.full(7, 8)
  inv[perm[:6]] = np.arange(6)
  ct = jnp.asarray(r.standard_normal((8, 3)), jnp.float32)
  plain = lambda a: jnp.sum(jnp.concatenate([a, jnp.zeros((1, 3))])[idx] * ct)
  ours = lambda a: jnp.sum(gmm_mod.take_rows(a, idx, jnp.asarray(inv, jnp.int32)) * ct)
  np.testing.assert_array_equal(np.asarray(ours(a)), np.asarray(plain(a)))
  np.testing.assert_array_equal(np.asarray(jax.grad(ours)(a)), np.asarray(jax.grad(plain)(a)))


def test_bad_inputs_raise_value_error():
  lhs, rhs, gs = _data(16, 4, 3, [8, 8])
  f = ops.grouped_matmul
  with pytest.raises(ValueError, match="lhs"):
    f(lhs[0], rhs, gs)
  with pytest.raises(ValueError, match="rhs"):
    f(lhs, rhs[0], gs)
  with pytest.raises(ValueError, match="K"):
    f(lhs[:, :3], rhs, gs)
  with pytest.raises(ValueError, match="group_sizes"):
    f(lhs, rhs, gs[:1])
  with pytest.raises(ValueError, match="group_sizes"):
    f(lhs, rhs, gs.astype(jnp.float32))
  with pytest.raises(ValueError, match="implementation"):
    f(lhs, rhs, gs, implementation="triton")


def test_pallas_dispatch_matches_reference():
  pytest.importorskip("pallas_kernels.grouped_matmul")
  lhs, rhs, gs = _data(256, 128, 128, [100, 0, 120, 20], seed=8)
  got = gmm(lhs, rhs, gs, implementation="pallas")
  np.testing.assert_allclose(np.asarray(got), _numpy_gmm(lhs, rhs, [100, 0, 120, 20]), rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("m, e, none_frac", [(64, 4, 0.0), (200, 8, 0.25), (5, 8, 0.4)])
def test_expert_ffn_tiled_layout_matches_reference(m, e, none_frac):
  """model.mlp.routed_experts: "xla" (the whole FFN in one padded-tile layout) against "reference" (three masked
  grouped matmuls), forward and gradients, with rows of "no expert" (id E: output and gradient 0)."""
  from stepflash_jax.model.mlp import routed_experts

  k = jax.random.split(jax.random.key(3), 5)
  h, f = 16, 8
  rows = jax.random.normal(k[0], (m, h))
  expert = jnp.where(jax.random.uniform(k[1], (m,)) < none_frac, e, jax.random.randint(k[2], (m,), 0, e))
  ws = [jax.random.normal(kk, s) * 0.3 for kk, s in zip(jax.random.split(k[3], 3), [(e, h, f), (e, h, f), (e, f, h)])]
  cot = jax.random.normal(k[4], (m, h))

  def run(impl):
    fn = lambda r, *w: jnp.sum(routed_experts(r, expert, *w, 1.5, impl) * cot)
    return routed_experts(rows, expert, *ws, 1.5, impl), jax.grad(fn, argnums=(0, 1, 2, 3))(rows, *ws)

  (y, g), (y_ref, g_ref) = run("xla"), run("reference")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  none = np.asarray(expert == e)
  assert not np.any(np.asarray(y)[none]) and not np.any(np.asarray(g[0])[none])


@pytest.mark.parametrize("backend,want", [("cpu", "xla"), ("gpu", "pallas"), ("tpu", "pallas")])
def test_implementation_none_follows_the_measured_winner(monkeypatch, backend, want):
  """None: the Triton gmm on a GPU (README "GPU": "xla" and ragged_dot ran out of memory at the real expert shapes,
  the kernel ran at ~300 TFLOP/s); attention keeps "xla" there (not measured against our banded path)."""
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  assert gmm_mod.resolve(None) == want
  assert gmm_mod.resolve("reference") == "reference"
  attention = importlib.import_module("stepflash_jax.ops.attention")
  assert attention.resolve_implementation(None) == ("pallas" if backend == "tpu" else "xla")
  if backend == "gpu":  # the public op lowers to the Triton kernel (lowered for CUDA from this host)
    sd = jax.ShapeDtypeStruct
    args = (sd((300, 256), jnp.bfloat16), sd((8, 256, 384), jnp.bfloat16), sd((8,), jnp.int32))
    text = jax.jit(ops.grouped_matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_bf16_weight_gradient_is_summed_in_fp32():
  """A group spread over many tiles: its bf16 weight gradient is the fp32 sum over the tiles, rounded once per tile
  (within ~2x the reference's own bf16 rounding of the float64 value; a bf16 scatter-add drifted ~10x)."""
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((1024, 16)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((2, 16, 16)), jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((1024, 16)), jnp.bfloat16)
  gs = jnp.array([600, 424], jnp.int32)
  L, C = np.asarray(lhs, np.float64), np.asarray(ct, np.float64)
  want = np.stack([L[:600].T @ C[:600], L[600:].T @ C[600:]])
  rounding = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64) - want).max()
  for tm in (8, None):
    _, vjp = jax.vjp(lambda r: gmm(lhs, r, gs, implementation="xla", tile_m=tm), rhs)
    got = np.asarray(vjp(ct)[0], np.float64)
    assert np.abs(got - want).max() <= 2 * rounding, tm
