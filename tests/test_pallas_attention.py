"""Pallas sliding-window attention: block skipping, fwd + dq/dk/dv vs the reference (interpret mode on CPU),
lowering for TPU (Mosaic) and CUDA (Triton), and the GPU kernels (interpreted here, on a GPU when present)."""

import functools
import re

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common, gpu
from pallas_kernels import sliding_window_attention as swa
from pallas_kernels.reference import attention_reference

F32, BF16 = jnp.float32, jnp.bfloat16


def _inputs(b, t, hq, hkv, d, dtype=F32, seg=False, seed=0):
  r = np.random.default_rng(seed)
  q, k, v, do = (
    jnp.asarray(r.standard_normal(s), dtype) for s in ((b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hq, d))
  )
  sid = None
  if seg:  # packed sequences: 3-4 segments per row
    sid = jnp.asarray(np.cumsum(r.random((b, t)) < 0.08, axis=1), jnp.int32)
  return q, k, v, do, sid


def _fwd_and_grads(fn, q, k, v, do, sid):
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v, sid).astype(F32) * do.astype(F32))

  o = jax.jit(fn)(q, k, v, sid)
  return o, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _assert_matches_reference(fn, q, k, v, do, sid, window, tol):
  o, grads = _fwd_and_grads(fn, q, k, v, do, sid)
  ref = lambda q, k, v, s: attention_reference(q, k, v, window=window, segment_ids=s)
  o_ref, grads_ref = _fwd_and_grads(ref, q, k, v, do, sid)
  assert o.dtype == q.dtype and o.shape == q.shape
  for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol, err_msg=name)


# ----------------------------------------------------------------------------------------------- block skipping
def test_visited_block_count_grows_with_t_times_w():
  t, w, b = 4096, 512, 128
  n = swa.num_visited_blocks(t, w, b, b)
  assert t * w // b**2 <= n <= t * w // b**2 + t // b  # ~T*W/b^2 (+ the diagonal)
  assert n == 5 * (t // b) - (4 + 3 + 2 + 1)  # 5 key blocks per query block, fewer at the start
  full = swa.num_visited_blocks(t, None, b, b)
  assert full == (t // b) * (t // b + 1) // 2  # full causal: lower triangle incl. diagonal
  assert n < full / 3


def _pallas_grids(fn, *args):
  """Grids of all pallas_calls in the (recursively traversed) jaxpr of fn."""
  grids = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        grids.append(tuple(eqn.params["grid_mapping"].grid))
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          if isinstance(sub, jex_core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jex_core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return grids


def test_kernel_grid_is_the_visited_pair_list():
  t, w, b = 4096, 512, 128
  sd = jax.ShapeDtypeStruct
  q, kv = sd((1, t, 2, 128), F32), sd((1, t, 1, 128), F32)
  fwd = functools.partial(swa.sliding_window_attention, window=w, interpret=True)
  grids = _pallas_grids(fwd, q, kv, kv)
  assert grids == [(1, 2, swa.num_visited_blocks(t, w, b, b))] == [(1, 2, 150)]
  grad = jax.grad(lambda q, k, v: fwd(q, k, v).sum(), argnums=(0, 1, 2))
  grids = _pallas_grids(grad, q, kv, kv)
  assert sorted(grids) == sorted([(1, 2, 150), (1, 2, 150), (1, 1, 150, 2)])  # fwd, dq, dkv (group innermost)


@pytest.mark.parametrize(
  "t,window,bq,bk",
  [(100, 7, 16, 16), (100, 40, 32, 16), (97, None, 16, 32), (64, 1, 16, 16), (50, 200, 32, 32), (130, 33, 64, 16)],
)
def test_visited_blocks_are_exactly_the_blocks_with_a_visible_pair(t, window, bq, bk):
  i = np.arange(t)[:, None]
  j = np.arange(t)[None, :]
  vis = (j <= i) & ((i - j < window) if window else True)
  needed = {
    (qi, kj)
    for qi in range(-(-t // bq))
    for kj in range(-(-t // bk))
    if vis[qi * bq : (qi + 1) * bq, kj * bk : (kj + 1) * bk].any()
  }
  pairs = swa.visited_blocks(t, window, bq, bk)
  assert len(pairs) == len(set(pairs)) and set(pairs) == needed
  assert pairs == sorted(pairs)  # q-major: each output block is finished before the next
  # the GPU dk/dv loop bounds are the exact transpose
  transposed = {
    (qi, kj)
    for kj in range(-(-t // bk))
    for qi in range(
      swa.q_block_range(kj, seq_len=t, window=window, block_q=bq, block_k=bk)[0],
      swa.q_block_range(kj, seq_len=t, window=window, block_q=bq, block_k=bk)[1] + 1,
    )
  }
  assert transposed == needed


# ----------------------------------------------------------------------------------------------- numerics
CASES = [
  # b, t, hq, hkv, d, window, bq, bk, seg, dtype
  pytest.param(1, 40, 2, 1, 16, 8, 16, 16, False, F32, id="window<T,T%block!=0"),
  pytest.param(2, 70, 8, 1, 16, None, 16, 32, True, F32, id="gqa8,segments,full-causal,bq!=bk"),
  pytest.param(1, 96, 12, 1, 32, 20, 32, 16, False, F32, id="gqa12,d32,window"),
  pytest.param(1, 50, 4, 2, 16, 200, 16, 16, True, BF16, id="bf16,window>T,segments"),
]


@pytest.mark.parametrize("b,t,hq,hkv,d,window,bq,bk,seg,dtype", CASES)
def test_matches_reference(b, t, hq, hkv, d, window, bq, bk, seg, dtype):
  q, k, v, do, sid = _inputs(b, t, hq, hkv, d, dtype, seg)
  fn = lambda q, k, v, s: swa.sliding_window_attention(q, k, v, window=window, segment_ids=s, block_q=bq, block_k=bk)
  _assert_matches_reference(fn, q, k, v, do, sid, window, 3e-2 if dtype == BF16 else 2e-5)


def test_default_128_blocks_tiny():
  q, k, v, do, sid = _inputs(1, 24, 2, 1, 16, F32, seg=True, seed=3)
  fn = lambda q, k, v, s: swa.sliding_window_attention(q, k, v, window=5, segment_ids=s, scale=0.3)
  o, grads = _fwd_and_grads(fn, q, k, v, do, sid)
  ref = lambda q, k, v, s: attention_reference(q, k, v, window=5, segment_ids=s, scale=0.3)
  o_ref, grads_ref = _fwd_and_grads(ref, q, k, v, do, sid)
  for a, b in zip((o, *grads), (o_ref, *grads_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_reference_matches_numpy_loop():
  q, k, v, _, _ = _inputs(1, 9, 4, 2, 4, seed=5)
  seg = np.array([[0] * 4 + [1] * 5], np.int32)
  o = np.asarray(attention_reference(q, k, v, window=3, segment_ids=jnp.asarray(seg), scale=0.5))
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  for i in range(9):
    js = [j for j in range(i + 1) if i - j < 3 and seg[0, i] == seg[0, j]]
    for h in range(4):
      s = np.array([qn[0, i, h] @ kn[0, j, h // 2] for j in js]) * 0.5
      p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
      np.testing.assert_allclose(o[0, i, h], p @ vn[0, js, h // 2], atol=1e-5)


def test_bad_inputs_raise():
  q, k, v, _, _ = _inputs(1, 8, 3, 2, 4)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    swa.sliding_window_attention(q, k, v)
  q, k, v, _, _ = _inputs(1, 8, 4, 2, 4)
  with pytest.raises(ValueError, match="segment_ids"):
    swa.sliding_window_attention(q, k, v, segment_ids=jnp.zeros((1, 7), jnp.int32))
  with pytest.raises(ValueError, match="window"):
    swa.sliding_window_attention(q, k, v, window=0)
  with pytest.raises(ValueError, match="dtype"):
    swa.sliding_window_attention(q, k.astype(BF16), v)
  with pytest.raises(ValueError, match="block_k"):
    swa.sliding_window_attention(q, k, v, block_k=0)
  with pytest.raises(ValueError, match="multiples of 128"):  # Mosaic tiling, checked before lowering
    swa.sliding_window_attention(q, k, v, block_q=64, interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    gpu.sliding_window_attention(q, k, v, block_q=48, interpret=True)


# ----------------------------------------------------------------------------------------------- lowering
def _custom_calls(fn, args, platform):
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  return re.findall(r"custom_call @([\w$.]+)", lowered.as_text())


@pytest.mark.parametrize("dtype,seg", [(BF16, True), (F32, False)])
def test_lowers_for_tpu_mosaic(dtype, seg):
  sd = jax.ShapeDtypeStruct
  args = [
    sd((1, 300, 4, 128), dtype),
    sd((1, 300, 2, 128), dtype),
    sd((1, 300, 2, 128), dtype),
    sd((1, 300), jnp.int32),
  ]

  def loss(q, k, v, s):
    o = swa.sliding_window_attention(q, k, v, window=200, segment_ids=s if seg else None, interpret=False)
    return o.astype(F32).sum()

  assert _custom_calls(jax.grad(loss, argnums=(0, 1, 2)), args, "tpu") == ["tpu_custom_call"] * 3


# ----------------------------------------------------------------------------------------------- GPU (Triton) path
def test_gpu_kernels_interpreted_match_reference():
  q, k, v, do, sid = _inputs(1, 45, 12, 1, 16, F32, seg=True, seed=7)
  fn = lambda q, k, v, s: gpu.sliding_window_attention(
    q, k, v, window=13, segment_ids=s, block_q=32, block_k=16, interpret=True
  )
  _assert_matches_reference(fn, q, k, v, do, sid, 13, 2e-5)


def test_public_entry_dispatches_to_triton_on_gpu_backend(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what ops sees on a GPU host
  sd = jax.ShapeDtypeStruct
  args = [sd((1, 300, 12, 128), BF16), sd((1, 300, 1, 128), BF16), sd((1, 300, 1, 128), BF16), sd((1, 300), jnp.int32)]

  def loss(q, k, v, s):
    o = swa.sliding_window_attention(q, k, v, window=128, segment_ids=s)  # default 128 blocks, interpret=None
    return o.astype(F32).sum()

  assert _custom_calls(jax.grad(loss, argnums=(0, 1, 2)), args, "cuda") == ["__gpu$xla.gpu.triton"] * 3


def test_public_entry_falls_back_to_xla_without_triton(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(common, "triton_available", lambda: False)  # a JAX without Pallas' Triton backend
  assert common.kernel_target() == "xla"
  q, k, v, _, sid = _inputs(1, 30, 4, 2, 16, F32, seg=True, seed=2)
  for s in (None, sid):
    got = swa.sliding_window_attention(q, k, v, window=7, segment_ids=s)
    want = attention_reference(q, k, v, window=7, segment_ids=s)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not gpu.has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,window,seg", [(F32, 64, True), (BF16, None, False), (BF16, 200, True)])
def test_gpu_matches_reference_on_device(dtype, window, seg):
  q, k, v, do, sid = _inputs(2, 300, 8, 2, 64, dtype, seg=seg, seed=11)
  fn = lambda q, k, v, s: swa.sliding_window_attention(q, k, v, window=window, segment_ids=s, block_q=64, block_k=64)
  _assert_matches_reference(fn, q, k, v, do, sid, window, 3e-2 if dtype == BF16 else 1e-4)
