"""ops.sliding_window_attention: reference vs a naive NumPy loop, banded "xla" vs reference (fwd + grads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax import ops
from stepflash_jax.ops import attention as attn_mod

# One compilation per configuration instead of op-by-op eager dispatch (much faster on a busy CPU).
swa = jax.jit(ops.sliding_window_attention, static_argnames=("window", "implementation", "scale", "chunk_size"))
banded = jax.jit(attn_mod.banded_attention, static_argnames=("window", "scale", "chunk_size"))


def _qkv(b, t, hq, hkv, d, seed=0, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  q = r.standard_normal((b, t, hq, d))
  k = r.standard_normal((b, t, hkv, d))
  v = r.standard_normal((b, t, hkv, d))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _naive(q, k, v, window, seg, scale):
  """Per (b, i, h) loop over visible keys, float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, hq, d = q.shape
  group = hq // k.shape[2]
  out = np.zeros_like(q)
  for bi in range(b):
    for i in range(t):
      js = [j for j in range(i + 1) if (window is None or i - j < window) and (seg is None or seg[bi, i] == seg[bi, j])]
      for h in range(hq):
        kv = h // group
        s = np.array([q[bi, i, h] @ k[bi, j, kv] for j in js]) * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        out[bi, i, h] = sum(pj * v[bi, j, kv] for pj, j in zip(p, js))
  return out


def test_reference_matches_naive_loop():
  q, k, v = _qkv(2, 11, 6, 2, 4, seed=1)
  seg = np.array([[0] * 5 + [1] * 6, [3] * 11], np.int32)
  for window, s in [(4, None), (3, seg), (None, seg)]:
    got = swa(
      q, k, v, window=window, segment_ids=None if s is None else jnp.asarray(s), implementation="reference", scale=0.7
    )
    np.testing.assert_allclose(np.asarray(got), _naive(q, k, v, window, s, 0.7), rtol=1e-5, atol=1e-5)


# (B, T, Hq, Hkv, D, window, chunk_size, with_segments)
CASES = [
  (2, 37, 8, 1, 8, 7, None, False),  # T not a multiple of the chunk, GQA group 8
  (1, 45, 12, 1, 4, 20, 8, True),  # group 12, window spans 3 previous chunks, packed segments
  (1, 30, 4, 2, 8, 1, None, False),  # window 1: each query sees only itself
  (2, 33, 4, 4, 8, 16, 16, True),  # window == chunk
  (1, 20, 4, 2, 8, 100, None, False),  # window > T -> causal
  (2, 19, 8, 2, 8, None, None, True),  # full causal with segments
]


def _segments(b, t, seed):
  r = np.random.default_rng(seed)
  return jnp.asarray(np.sort(r.integers(0, 3, (b, t)), axis=1), jnp.int32)


@pytest.mark.parametrize("b,t,hq,hkv,d,window,chunk,with_seg", CASES)
def test_xla_matches_reference_fwd_and_grads(b, t, hq, hkv, d, window, chunk, with_seg):
  q, k, v = _qkv(b, t, hq, hkv, d, seed=t)
  seg = _segments(b, t, t) if with_seg else None
  ct = jnp.asarray(np.random.default_rng(99).standard_normal(q.shape), jnp.float32)

  def loss(impl):
    def f(q, k, v):
      kw = {"chunk_size": chunk} if impl == "xla" else {}
      o = ops.sliding_window_attention(q, k, v, window=window, segment_ids=seg, implementation=impl, **kw)
      return jnp.sum(o * ct), o

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

  (_, o_ref), g_ref = loss("reference")(q, k, v)
  (_, o_xla), g_xla = loss("xla")(q, k, v)
  np.testing.assert_allclose(np.asarray(o_xla), np.asarray(o_ref), rtol=1e-5, atol=1e-5)
  for name, a, r in zip("dq dk dv".split(), g_xla, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-4, err_msg=name)


def test_banded_path_is_used_and_chunk_size_does_not_matter():
  q, k, v = _qkv(1, 50, 4, 1, 8, seed=3)
  ref = swa(q, k, v, window=13, implementation="reference", scale=0.3)
  for c in (1, 5, 16, 64):  # 64 > T: capped to the 8-rounded sequence length
    got = banded(q, k, v, window=13, chunk_size=c, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5, err_msg=f"C={c}")
  # The default implementation on CPU is the banded xla path.
  np.testing.assert_array_equal(
    np.asarray(swa(q, k, v, window=13, scale=0.3)), np.asarray(banded(q, k, v, window=13, scale=0.3))
  )


@pytest.mark.parametrize("window", [5, None])
def test_packed_batch_equals_each_segment_alone(window):
  lengths = [9, 1, 14]
  t = sum(lengths)
  q, k, v = _qkv(1, t, 8, 2, 8, seed=5)
  seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
  packed = swa(q, k, v, window=window, segment_ids=seg, implementation="xla", chunk_size=8)
  start = 0
  for n in lengths:
    sl = slice(start, start + n)
    alone = swa(q[:, sl], k[:, sl], v[:, sl], window=window, implementation="xla", chunk_size=8)
    np.testing.assert_allclose(np.asarray(packed[:, sl]), np.asarray(alone), rtol=1e-5, atol=1e-5)
    start += n


@pytest.mark.parametrize("window", [6, None])
def test_bf16_inputs(window):
  q, k, v = _qkv(1, 40, 12, 1, 16, seed=7, dtype=jnp.bfloat16)
  out = swa(q, k, v, window=window, implementation="xla", chunk_size=8)
  assert out.dtype == jnp.bfloat16
  ref = swa(
    q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), window=window, implementation="reference"
  )
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=3e-2, atol=3e-2)
  g = jax.jit(jax.grad(lambda q: jnp.sum(ops.sliding_window_attention(q, k, v, window=window).astype(jnp.float32))))(q)
  assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))


def test_bf16_key_value_gradients_are_summed_in_fp32():
  """Each key sits in up to P + 1 = 33 query chunks' bands (window 256, chunk 8): their gradients are added in fp32,
  so the bf16 "xla" dk / dv are within 1.3x the bf16 reference's own rounding of the fp32 result (adding the bands in
  bf16 gave 2.2x)."""
  x32 = _qkv(1, 300, 4, 2, 16, seed=0)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((1, 300, 4, 16)), jnp.float32)

  def grads(implementation, dtype):
    def loss(k, v):
      o = ops.sliding_window_attention(
        x32[0].astype(dtype),
        k.astype(dtype),
        v.astype(dtype),
        window=256,
        implementation=implementation,
        chunk_size=8 if implementation == "xla" else None,
      )
      return jnp.sum(o.astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(*x32[1:])

  exact = grads("reference", jnp.float32)
  err = lambda gs: [float(jnp.linalg.norm(g.astype(jnp.float32) - e) / jnp.linalg.norm(e)) for g, e in zip(gs, exact)]
  for banded_err, rounding in zip(err(grads("xla", jnp.bfloat16)), err(grads("reference", jnp.bfloat16))):
    assert banded_err <= 1.3 * rounding, (banded_err, rounding)


def test_bad_inputs_raise_value_error():
  q, k, v = _qkv(1, 8, 4, 2, 8)
  f = ops.sliding_window_attention
  with pytest.raises(ValueError, match="q"):
    f(q[0], k, v, window=4)
  with pytest.raises(ValueError, match="multiple"):
    f(q[:, :, :3], k, v, window=4)
  with pytest.raises(ValueError, match="k shape"):
    f(q, k[:, :7], v[:, :7], window=4)
  with pytest.raises(ValueError, match="v"):
    f(q, k, v[..., :4], window=4)
  with pytest.raises(ValueError, match="window"):
    f(q, k, v, window=0)
  with pytest.raises(ValueError, match="segment_ids"):
    f(q, k, v, window=4, segment_ids=jnp.zeros((1, 7), jnp.int32))
  with pytest.raises(ValueError, match="implementation"):
    f(q, k, v, window=4, implementation="cuda")


def test_pallas_dispatch_matches_reference():
  pytest.importorskip("pallas_kernels.sliding_window_attention")
  q, k, v = _qkv(1, 64, 4, 2, 16, seed=11)
  seg = jnp.asarray(np.repeat([0, 1], [40, 24])[None], jnp.int32)
  got = ops.sliding_window_attention(q, k, v, window=16, segment_ids=seg, implementation="pallas")
  ref = ops.sliding_window_attention(q, k, v, window=16, segment_ids=seg, implementation="reference")
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("implementation", ["reference", "xla", "pallas"])
def test_qkv_must_share_one_float_dtype(implementation):
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  k = v = jnp.zeros((1, 8, 1, 16), jnp.float32)
  with pytest.raises(ValueError, match="one float dtype"):
    ops.sliding_window_attention(q, k, v, window=4, implementation=implementation)
  ints = jnp.zeros((1, 8, 1, 16), jnp.int32)
  with pytest.raises(ValueError, match="one float dtype"):
    ops.sliding_window_attention(ints.repeat(2, 2), ints, ints, window=4, implementation=implementation)
