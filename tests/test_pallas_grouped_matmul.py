"""Pallas grouped matmul: visit metadata, gmm/tgmm + gradients vs the reference (interpret mode on CPU), empty
groups, tiles straddling group boundaries, rows past the sum zeroed, lowering for TPU and CUDA, GPU kernels."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common, gpu
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.reference import gmm_reference, tgmm_reference

F32, BF16 = jnp.float32, jnp.bfloat16
M, K, N, G = 70, 24, 40, 6
# dynamic group sizes reuse one compilation: empty groups (first, middle, last), straddled tiles, sum < M, sum = M
GROUP_SIZES = [[5, 0, 17, 0, 30, 3], [0, 16, 16, 0, 2, 0], [70, 0, 0, 0, 0, 0], [0] * 6, [11, 11, 11, 11, 11, 15]]
TILES = dict(tile_m=16, tile_k=16, tile_n=16)


def _data(dtype=F32, seed=0, m=M, k=K, n=N, g=G):
  r = np.random.default_rng(seed)
  return tuple(jnp.asarray(r.standard_normal(s), dtype) for s in ((m, k), (g, k, n), (m, n)))


def _numpy_gmm(lhs, rhs, sizes):
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out, start = np.zeros((lhs.shape[0], rhs.shape[2])), 0
  for g, s in enumerate(sizes):
    out[start : start + s] = lhs[start : start + s] @ rhs[g]
    start += s
  return out


def _numpy_tgmm(lhs, grad, sizes):
  lhs, grad = np.asarray(lhs, np.float64), np.asarray(grad, np.float64)
  out, start = np.zeros((len(sizes), lhs.shape[1], grad.shape[1])), 0
  for g, s in enumerate(sizes):
    out[g] = lhs[start : start + s].T @ grad[start : start + s]
    start += s
  return out


def test_reference_matches_numpy_loop():
  lhs, rhs, dout = _data(m=13, k=3, n=4, g=3)
  sizes = [4, 0, 6]
  gs = jnp.asarray(sizes, jnp.int32)
  np.testing.assert_allclose(gmm_reference(lhs, rhs, gs), _numpy_gmm(lhs, rhs, sizes), atol=1e-5)
  np.testing.assert_allclose(tgmm_reference(lhs, dout, gs), _numpy_tgmm(lhs, dout, sizes), atol=1e-5)


def _visits_loop(sizes, m_pad, tm, with_tail, visit_empty):
  """Naive visit list: every (group, m_tile) a group's rows overlap, in row order."""
  sizes = list(sizes) + ([m_pad - sum(sizes)] if with_tail else [])
  visits, start = [], 0
  for g, s in enumerate(sizes):
    if s:
      visits += [(g, t) for t in range(start // tm, (start + s - 1) // tm + 1)]
    elif visit_empty:
      visits.append((g, min(start // tm, m_pad // tm - 1)))
    start += s
  return visits


@pytest.mark.parametrize("with_tail,visit_empty", [(True, False), (False, True)])
def test_group_metadata_visits(with_tail, visit_empty):
  m_pad, tm = 80, 16
  meta = jax.jit(functools.partial(gm.group_metadata, m_pad=m_pad, tm=tm, with_tail=with_tail, visit_empty=visit_empty))
  rng = np.random.default_rng(0)
  draws = GROUP_SIZES + [list(rng.multinomial(rng.integers(0, M + 1), [1 / G] * G)) for _ in range(20)]
  for sizes in draws:
    group, tile, starts, ends, n_vis, n_bound = meta(jnp.asarray(sizes, jnp.int32))
    want = _visits_loop(sizes, m_pad, tm, with_tail, visit_empty)
    n = int(n_vis[0])
    assert n == len(want) <= n_bound == group.shape[0], sizes
    assert list(zip(np.asarray(group[:n]).tolist(), np.asarray(tile[:n]).tolist())) == want, sizes
    # dead visits repeat the last real one (same blocks: no extra DMA, no extra output block)
    assert (np.asarray(group[n:]) == want[-1][0]).all() and (np.asarray(tile[n:]) == want[-1][1]).all()
    assert (np.asarray(ends) - np.asarray(starts)).tolist()[:G] == list(sizes)


def _check_gmm_family(gmm_fn, tgmm_fn, dtype, tol, draws=GROUP_SIZES):
  lhs, rhs, dout = _data(dtype)
  fwd = jax.jit(gmm_fn)
  grads = jax.jit(jax.grad(lambda a, b, g: jnp.sum(gmm_fn(a, b, g).astype(F32) * dout.astype(F32)), argnums=(0, 1)))
  tg = jax.jit(tgmm_fn)
  ref_grads = jax.jit(
    jax.grad(lambda a, b, g: jnp.sum(gmm_reference(a, b, g).astype(F32) * dout.astype(F32)), argnums=(0, 1))
  )
  close = functools.partial(np.testing.assert_allclose, atol=tol, rtol=tol)
  for sizes in draws:
    gs = jnp.asarray(sizes, jnp.int32)
    out = fwd(lhs, rhs, gs)
    assert out.shape == (M, N) and out.dtype == dtype
    close(np.asarray(out, np.float32), np.asarray(gmm_reference(lhs, rhs, gs), np.float32), err_msg=str(sizes))
    assert (np.asarray(out[sum(sizes) :]) == 0).all()  # rows past the sum: exactly 0
    (dl, dr), (rl, rr) = grads(lhs, rhs, gs), ref_grads(lhs, rhs, gs)
    close(np.asarray(dl, np.float32), np.asarray(rl, np.float32), err_msg=f"dlhs {sizes}")
    close(np.asarray(dr, np.float32), np.asarray(rr, np.float32), err_msg=f"drhs {sizes}")
    t = tg(lhs, dout, gs)
    assert t.shape == (G, K, N)
    close(np.asarray(t, np.float32), np.asarray(tgmm_reference(lhs, dout, gs), np.float32), err_msg=str(sizes))
    assert all((np.asarray(t[g]) == 0).all() for g in range(G) if sizes[g] == 0)  # empty group: zero slice


def test_gmm_tgmm_match_reference_f32():
  _check_gmm_family(lambda a, b, g: gm.gmm(a, b, g, **TILES), lambda a, d, g: gm.tgmm(a, d, g, **TILES), F32, 2e-5)


def test_gmm_tgmm_bf16():
  _check_gmm_family(
    lambda a, b, g: gm.gmm(a, b, g, **TILES),
    lambda a, d, g: gm.tgmm(a, d, g, **TILES),
    BF16,
    5e-2,
    draws=GROUP_SIZES[:2],
  )


def test_default_128_tiles_tiny_and_nan_rows_past_sum():
  lhs, rhs, _ = _data(m=40, k=16, n=24, g=3, seed=2)
  lhs = lhs.at[30:].set(jnp.nan)  # garbage (e.g. dropped-token padding) past sum(group_sizes) = 30
  gs = jnp.asarray([10, 0, 20], jnp.int32)
  out = jax.jit(gm.gmm)(lhs, rhs, gs)
  np.testing.assert_allclose(out[:30], _numpy_gmm(lhs[:30], rhs, [10, 0, 20])[:30], atol=2e-5, rtol=2e-5)
  assert (np.asarray(out[30:]) == 0).all()


def test_bad_inputs_raise():
  lhs, rhs, dout = _data(m=8, k=4, n=4, g=2)
  gs = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="rhs"):
    gm.gmm(lhs, rhs[:, :3], gs)
  with pytest.raises(ValueError, match="group_sizes"):
    gm.gmm(lhs, rhs, jnp.asarray([4, 2, 2], jnp.int32))
  with pytest.raises(ValueError, match="group_sizes"):
    gm.gmm(lhs, rhs, jnp.asarray([4.0, 4.0]))
  with pytest.raises(ValueError, match="lhs"):
    gm.tgmm(lhs[None], dout, gs)
  with pytest.raises(ValueError, match="grad"):
    gm.tgmm(lhs, dout[:5], gs)
  with pytest.raises(ValueError, match="tile_m"):
    gm.gmm(lhs, rhs, gs, tile_m=0)


def _custom_calls(fn, args, platform):
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  return re.findall(r"custom_call @([\w$.]+)", lowered.as_text())


def _lowering_args():
  sd = jax.ShapeDtypeStruct
  return [sd((300, 256), BF16), sd((8, 256, 384), BF16), sd((8,), jnp.int32)]


def test_lowers_for_tpu_mosaic():
  loss = lambda a, b, g: gm.gmm(a, b, g, interpret=False).astype(F32).sum()
  assert _custom_calls(jax.grad(loss, argnums=(0, 1)), _lowering_args(), "tpu") == ["tpu_custom_call"] * 3


# ----------------------------------------------------------------------------------------------- GPU (Triton) path
def test_gpu_kernels_interpreted_match_reference():
  _check_gmm_family(
    lambda a, b, g: gpu.gmm(a, b, g, interpret=True, **TILES),
    lambda a, d, g: gpu.tgmm(a, d, g, interpret=True, **TILES),
    F32,
    2e-5,
    draws=GROUP_SIZES[:2],
  )


def test_public_entry_dispatches_to_triton_on_gpu_backend(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what ops sees on a GPU host
  loss = lambda a, b, g: gm.gmm(a, b, g).astype(F32).sum()
  assert _custom_calls(jax.grad(loss, argnums=(0, 1)), _lowering_args(), "cuda") == ["__gpu$xla.gpu.triton"] * 3


def test_xla_fallbacks_match_reference():
  lhs, rhs, dout = _data()
  gs = jnp.asarray(GROUP_SIZES[0], jnp.int32)
  np.testing.assert_allclose(gpu.xla_gmm(lhs, rhs, gs), gmm_reference(lhs, rhs, gs), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(gpu.xla_tgmm(lhs, dout, gs), tgmm_reference(lhs, dout, gs), atol=2e-5, rtol=2e-5)


def test_public_entries_fall_back_to_ragged_dot_without_triton(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(common, "triton_available", lambda: False)  # a JAX without Pallas' Triton backend
  lhs, rhs, dout = _data()
  gs = jnp.asarray(GROUP_SIZES[0], jnp.int32)
  np.testing.assert_allclose(gm.gmm(lhs, rhs, gs), gmm_reference(lhs, rhs, gs), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(gm.tgmm(lhs, dout, gs), tgmm_reference(lhs, dout, gs), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not gpu.has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gpu_matches_reference_on_device(dtype):
  tiles = dict(tile_m=16, tile_k=16, tile_n=16)
  _check_gmm_family(
    lambda a, b, g: gm.gmm(a, b, g, **tiles),
    lambda a, d, g: gm.tgmm(a, d, g, **tiles),
    dtype,
    5e-2 if dtype == BF16 else 1e-4,
  )
