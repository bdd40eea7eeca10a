"""GPU check + benchmark of the Pallas (Triton-lowered) kernels against XLA/cuDNN baselines.

  python experiments/benchmarks/gpu_kernels.py --sweep    # on a GPU: realistic shapes, ~2 minutes (H200)
  python experiments/benchmarks/gpu_kernels.py --small    # tiny shapes; on CPU runs the kernels in interpret mode

1. Correctness: attention (fwd, dq, dk, dv) and gmm / tgmm (fwd, dlhs, drhs) vs pallas_kernels.reference, as the
   largest error relative to the output's largest magnitude (fp32 <= 1e-4, bf16 <= 1e-2).
2. Timing (median of --iters after warm-up), bf16:
   * sliding-window attention, B=1, T in --seq-lens (4K-32K), W=512, 96 query / 8 kv heads, D=128:
     ours vs jax.nn.dot_product_attention(implementation="cudnn", is_causal=True, local_window_size=(W-1, 0));
     forward and forward+backward.
   * MoE expert matmul, --moe_tokens (2K, 16K) tokens x top-8 rows routed to 288 experts, 4096 -> 1280:
     ours (gmm, custom_vjp with tgmm) vs jax.lax.ragged_dot; forward and forward+backward.
   * --sweep: other attention blocks at T=16K and gmm tiles at the last --moe_tokens, fwd+bwd.
Without a GPU (and without --small) it prints a message and exits 0. --out writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import gpu  # noqa: E402
from pallas_kernels.reference import attention_reference, gmm_reference, tgmm_reference  # noqa: E402


def _timeit(fn, *args, iters):
  """Median wall time (ms) of a jitted fn after one compile+warm-up call; also returns the compile time (s)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return float(np.median(times)), compile_s


def _max_err(a, b):
  """max |a - b| / max |b|: the largest error relative to the output's scale (bf16 outputs round by ~2^-9 of it)."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def _fwd_bwd(f):
  """jit(value_and_grad) of sum(f(*args) * cotangent) w.r.t. every argument but the last (the cotangent)."""

  def loss(*args):
    *xs, ct = args
    return jnp.sum(f(*xs).astype(jnp.float32) * ct.astype(jnp.float32))

  return lambda *args: jax.grad(loss, argnums=tuple(range(len(args) - 1)))(*args)


# ----------------------------------------------------------------------------------------------- attention
def _attn_inputs(key, b, t, hq, hkv, d, dtype):
  ks = jax.random.split(key, 4)
  return (
    jax.random.normal(ks[0], (b, t, hq, d), dtype),
    jax.random.normal(ks[1], (b, t, hkv, d), dtype),
    jax.random.normal(ks[2], (b, t, hkv, d), dtype),
    jax.random.normal(ks[3], (b, t, hq, d), dtype),
  )


def check_attention(shape, window, blocks, interpret, dtype, tol):
  b, t, hq, hkv, d = shape
  q, k, v, do = _attn_inputs(jax.random.key(0), b, t, hq, hkv, d, dtype)
  seg = jnp.asarray(np.cumsum(np.random.default_rng(0).random((b, t)) < 4.0 / t, axis=1), jnp.int32)
  ours = lambda q, k, v: gpu.sliding_window_attention(
    q, k, v, window=window, segment_ids=seg, interpret=interpret, **blocks
  )
  ref = lambda q, k, v: attention_reference(q, k, v, window=window, segment_ids=seg)
  errs = {"o": _max_err(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v))}
  g_ours = jax.jit(_fwd_bwd(ours))(q, k, v, do)
  g_ref = jax.jit(_fwd_bwd(ref))(q, k, v, do)
  errs.update({n: _max_err(a, r) for n, a, r in zip(("dq", "dk", "dv"), g_ours, g_ref)})
  ok = all(e <= tol for e in errs.values())
  print(
    f"[check] attention {shape} window={window} {jnp.dtype(dtype).name}: "
    + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    + ("  OK" if ok else f"  FAIL (tol {tol})")
  )
  return ok, errs


def bench_attention(t, window, heads, d, blocks, interpret, iters, baseline):
  hq, hkv = heads
  q, k, v, do = _attn_inputs(jax.random.key(1), 1, t, hq, hkv, d, jnp.bfloat16)
  ours = lambda q, k, v: gpu.sliding_window_attention(q, k, v, window=window, interpret=interpret, **blocks)
  if baseline == "cudnn":
    base = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn", local_window_size=(window - 1, 0)
    )
  else:  # CPU --small: XLA reference kernel of dot_product_attention
    base = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla", local_window_size=(window - 1, 0)
    )
  visible = sum(min(i + 1, window) for i in range(t))
  flops_fwd = 4 * hq * d * visible
  row = {"T": t, "W": window, "Hq": hq, "Hkv": hkv, "D": d}
  for name, f in (("ours", ours), (baseline, base)):
    for mode, fn, flops in (("fwd", jax.jit(f), flops_fwd), ("fwd+bwd", jax.jit(_fwd_bwd(f)), 3.5 * flops_fwd)):
      args = (q, k, v) if mode == "fwd" else (q, k, v, do)
      try:
        ms, comp = _timeit(fn, *args, iters=iters)
        row[f"{name} {mode} ms"] = round(ms, 3)
        row[f"{name} {mode} TFLOP/s"] = round(flops / ms / 1e9, 1)
      except Exception as e:  # noqa: BLE001  (e.g. cuDNN without sliding-window support)
        row[f"{name} {mode} ms"] = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
  print("[time] attention", row)
  return row


# ----------------------------------------------------------------------------------------------- grouped matmul
def _routing_group_sizes(rng, tokens, experts, top_k):
  """Group sizes of a random top-k routing (skewed, with some empty experts)."""
  logits = rng.gumbel(size=(tokens, experts)) + np.log(rng.dirichlet(np.full(experts, 0.3)))[None]
  chosen = np.argsort(-logits, axis=1)[:, :top_k]
  return jnp.asarray(np.bincount(chosen.ravel(), minlength=experts), jnp.int32)


def check_gmm(m, k, n, g, tiles, interpret, dtype, tol):
  rng = np.random.default_rng(0)
  ks = jax.random.split(jax.random.key(2), 3)
  lhs = jax.random.normal(ks[0], (m, k), dtype)
  rhs = (jax.random.normal(ks[1], (g, k, n), jnp.float32) * k**-0.5).astype(dtype)
  dout = jax.random.normal(ks[2], (m, n), dtype)
  sizes = rng.multinomial(m - 3, rng.dirichlet(np.full(g, 0.5)))  # 3 rows past the sum, empty groups likely
  gs = jnp.asarray(sizes, jnp.int32)
  ours = lambda a, b: gpu.gmm(a, b, gs, interpret=interpret, **tiles)
  ref = lambda a, b: gmm_reference(a, b, gs)
  out = jax.jit(ours)(lhs, rhs)
  errs = {"out": _max_err(out, jax.jit(ref)(lhs, rhs)), "rows_past_sum": float(jnp.abs(out[m - 3 :]).max())}
  d_ours = jax.jit(_fwd_bwd(ours))(lhs, rhs, dout)
  d_ref = jax.jit(_fwd_bwd(ref))(lhs, rhs, dout)
  errs.update({"dlhs": _max_err(d_ours[0], d_ref[0]), "drhs": _max_err(d_ours[1], d_ref[1])})
  t_ours = jax.jit(lambda a, d: gpu.tgmm(a, d, gs, interpret=interpret, **tiles))(lhs, dout)
  errs["tgmm"] = _max_err(t_ours, tgmm_reference(lhs, dout, gs))
  ok = all(e <= tol for e in errs.values()) and errs["rows_past_sum"] == 0.0
  print(
    f"[check] gmm M={m} K={k} N={n} G={g} empty_groups={int((sizes == 0).sum())} {jnp.dtype(dtype).name}: "
    + " ".join(f"{n_}={e:.2e}" for n_, e in errs.items())
    + ("  OK" if ok else f"  FAIL (tol {tol})")
  )
  return ok, errs


def bench_gmm(tokens, top_k, experts, k, n, tiles, interpret, iters):
  rng = np.random.default_rng(1)
  gs = _routing_group_sizes(rng, tokens, experts, top_k)
  m = tokens * top_k
  ks = jax.random.split(jax.random.key(3), 3)
  lhs = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
  rhs = (jax.random.normal(ks[1], (experts, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
  dout = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
  ours = lambda a, b: gpu.gmm(a, b, gs, interpret=interpret, **tiles)
  base = lambda a, b: jax.lax.ragged_dot(a, b, gs)
  row = {"M": m, "K": k, "N": n, "G": experts, "empty_groups": int((np.asarray(gs) == 0).sum())}
  flops = 2 * m * k * n
  for name, f in (("ours", ours), ("ragged_dot", base)):
    for mode, fn, fl in (("fwd", jax.jit(f), flops), ("fwd+bwd", jax.jit(_fwd_bwd(f)), 3 * flops)):
      args = (lhs, rhs) if mode == "fwd" else (lhs, rhs, dout)
      try:
        ms, _ = _timeit(fn, *args, iters=iters)
        row[f"{name} {mode} ms"] = round(ms, 3)
        row[f"{name} {mode} TFLOP/s"] = round(fl / ms / 1e9, 1)
      except Exception as e:  # noqa: BLE001  (jax 0.11's GPU ragged_dot runs densely: out of memory at 16K tokens)
        row[f"{name} {mode} ms"] = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
  print("[time] gmm", row)
  return row


# ----------------------------------------------------------------------------------------------- tile sweep
def sweep(t, window, heads, d, moe, attn_blocks, gmm_tiles, interpret, iters):
  """fwd+bwd ms of our kernels for each attention block / gmm tile choice (T = t; the gmm shape of bench_gmm)."""
  hq, hkv = heads
  q, k, v, do = _attn_inputs(jax.random.key(1), 1, t, hq, hkv, d, jnp.bfloat16)
  rows = []
  for bq, bk in attn_blocks:
    f = lambda q, k, v, bq=bq, bk=bk: gpu.sliding_window_attention(
      q, k, v, window=window, block_q=bq, block_k=bk, interpret=interpret
    )
    rows.append({"kernel": "attention", "T": t, "block_q": bq, "block_k": bk})
    rows[-1]["fwd+bwd ms"] = round(_timeit(jax.jit(_fwd_bwd(f)), q, k, v, do, iters=iters)[0], 3)
    print("[sweep]", rows[-1])
  gs = _routing_group_sizes(np.random.default_rng(1), moe["tokens"][-1], moe["experts"], moe["top_k"])
  ks = jax.random.split(jax.random.key(3), 3)
  m = moe["tokens"][-1] * moe["top_k"]
  lhs = jax.random.normal(ks[0], (m, moe["k"]), jnp.bfloat16)
  rhs = (jax.random.normal(ks[1], (moe["experts"], moe["k"], moe["n"]), jnp.float32) * moe["k"] ** -0.5).astype(
    jnp.bfloat16
  )
  dout = jax.random.normal(ks[2], (m, moe["n"]), jnp.bfloat16)
  for tm, tk, tn in gmm_tiles:
    f = lambda a, b, tm=tm, tk=tk, tn=tn: gpu.gmm(a, b, gs, tile_m=tm, tile_k=tk, tile_n=tn, interpret=interpret)
    rows.append({"kernel": "gmm", "M": m, "tile_m": tm, "tile_k": tk, "tile_n": tn})
    rows[-1]["fwd+bwd ms"] = round(_timeit(jax.jit(_fwd_bwd(f)), lhs, rhs, dout, iters=iters)[0], 3)
    print("[sweep]", rows[-1])
  return rows


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="tiny shapes (interpret mode on CPU) to test the script")
  p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--moe_tokens", type=int, nargs="+", default=[2048, 16384])
  p.add_argument("--budget_s", type=float, default=150.0, help="time no new configuration after this")
  p.add_argument("--sweep", action="store_true", help="then time other attention blocks (T=16K) / gmm tiles")
  p.add_argument("--out", default=None, help="write results JSON here")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)

  on_gpu = gpu.has_gpu()
  if not on_gpu and not args.small:
    print(
      f"No GPU found (jax backend: {jax.default_backend()}); nothing to benchmark. "
      "Use --small to run tiny shapes in interpret mode."
    )
    return 0
  if on_gpu and not gpu.triton_available():
    print(
      "Pallas' Triton backend is unavailable in this jax; the kernels fall back to XLA (see "
      "pallas_kernels/gpu/__init__.py), so there is nothing of ours to benchmark."
    )
    return 0
  interpret = not on_gpu
  start = time.perf_counter()
  results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "checks": [], "attention": [], "gmm": []}

  if args.small:
    attn_blocks, gmm_tiles = dict(block_q=16, block_k=16), dict(tile_m=16, tile_k=16, tile_n=16)
    checks = [((1, 40, 4, 1, 16), 9, jnp.float32, 2e-5 if interpret else 1e-4)]
    gmm_check = (40, 16, 32, 5)
    seq_lens, window, heads, d, iters = [64], 16, (4, 1), 16, 2
    moe = dict(tokens=[16], top_k=2, experts=6, k=32, n=32)
  else:
    # 64 / 64 attention blocks: the fastest of 5 at T=16K on the H200 (README "GPU"); gmm tiles = the defaults.
    attn_blocks, gmm_tiles = dict(block_q=64, block_k=64), dict(tile_m=64, tile_k=64, tile_n=128)
    checks = [((2, 700, 16, 2, 128), 200, jnp.float32, 1e-4), ((1, 1024, 12, 1, 128), 512, jnp.bfloat16, 1e-2)]
    gmm_check = (1000, 256, 384, 17)
    seq_lens, window, heads, d, iters = args.seq_lens, args.window, (96, 8), 128, args.iters
    moe = dict(tokens=args.moe_tokens, top_k=8, experts=288, k=4096, n=1280)

  def guarded(label, fn, *a):  # report a failure and go on: one broken kernel must not lose the other figures
    try:
      return fn(*a)
    except Exception as e:  # noqa: BLE001
      print(f"[{label}] failed: {type(e).__name__}: {str(e)[:600]}")
      results.setdefault("errors", []).append(f"{label}: {type(e).__name__}: {str(e)[:600]}")

  ok = True
  for shape, w, dtype, tol in checks:
    good, errs = guarded("check attention", check_attention, shape, w, attn_blocks, interpret, dtype, tol) or (0, {})
    ok &= bool(good)
    results["checks"].append({"kernel": "attention", "shape": shape, "window": w, "ok": bool(good), **errs})
  tol = 1e-4 if on_gpu else 2e-5
  good, errs = guarded("check gmm", check_gmm, *gmm_check, gmm_tiles, interpret, jnp.float32, tol) or (0, {})
  ok &= bool(good)
  results["checks"].append({"kernel": "gmm", "shape": gmm_check, "ok": bool(good), **errs})

  baseline = "cudnn" if on_gpu else "xla"
  for t in seq_lens:
    if time.perf_counter() - start > args.budget_s:
      print(f"[time] budget reached, skipping T={t}")
      continue
    row = guarded(f"attention T={t}", bench_attention, t, window, heads, d, attn_blocks, interpret, iters, baseline)
    results["attention"].append(row)
  for tokens in moe["tokens"]:
    if time.perf_counter() - start <= args.budget_s:
      moe_args = (tokens, moe["top_k"], moe["experts"], moe["k"], moe["n"], gmm_tiles, interpret, iters)
      results["gmm"].append(guarded(f"gmm tokens={tokens}", bench_gmm, *moe_args))
  if args.sweep:
    blocks = [(128, 64), (128, 128)] if on_gpu else [(16, 32)]
    tiles = [(128, 64, 128), (128, 128, 128), (64, 128, 128), (128, 64, 256)] if on_gpu else [(32, 16, 16)]
    t_sweep = 16384 if on_gpu else 64
    results["sweep"] = guarded("sweep", sweep, t_sweep, window, heads, d, moe, blocks, tiles, interpret, iters)
  results["seconds"] = round(time.perf_counter() - start, 1)
  print(f"done in {results['seconds']} s; checks {'OK' if ok else 'FAILED'}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1, default=str)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
