"""Banded ("xla") vs dense ("reference") sliding-window attention, fwd+bwd, on the current backend.

    python experiments/benchmarks/attention.py [--seq_len 4096 --window 512 --q_heads 8 --kv_heads 1 --head_dim 64]

Prints a table of median wall times and two ratios:
  dense / banded at T=seq_len        (goal >= 3: banded work is O(T * W), dense O(T^2))
  banded(2T) / banded(T)              (goal <= 2.3: linear in T)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from stepflash_jax import ops
from timing import bench  # experiments/benchmarks/timing.py (the script's folder is on sys.path)


def fwd_bwd(implementation, window, chunk_size):
  def loss(q, k, v):
    kw = {"chunk_size": chunk_size} if implementation == "xla" else {}
    o = ops.sliding_window_attention(q, k, v, window=window, implementation=implementation, **kw)
    return jnp.sum(o.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(b, t, hq, hkv, d, dtype, seed=0):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (
    jax.random.normal(kq, (b, t, hq, d), dtype),
    jax.random.normal(kk, (b, t, hkv, d), dtype),
    jax.random.normal(kv, (b, t, hkv, d), dtype),
  )


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq_len", type=int, default=4096)
  ap.add_argument("--window", type=int, default=512)
  ap.add_argument("--q_heads", type=int, default=8)
  ap.add_argument("--kv_heads", type=int, default=1)
  ap.add_argument("--head_dim", type=int, default=64)
  ap.add_argument("--chunk_size", type=int, default=None, help="banded query chunk (default: the op's)")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dense_reps", type=int, default=3, help="dense is slow on CPU; fewer reps")
  a = ap.parse_args()
  dtype = jnp.dtype(a.dtype)
  print(
    f"backend={jax.default_backend()} B={a.batch} Hq={a.q_heads} Hkv={a.kv_heads} D={a.head_dim} "
    f"W={a.window} dtype={dtype.name} chunk={a.chunk_size or 'default'}; fwd+bwd (dq, dk, dv), {a.reps} reps "
    f"({a.dense_reps} dense)"
  )

  t1, t2 = a.seq_len, 2 * a.seq_len
  band = {
    f"banded (xla) T={t}": (
      fwd_bwd("xla", a.window, a.chunk_size),
      inputs(a.batch, t, a.q_heads, a.kv_heads, a.head_dim, dtype),
    )
    for t in (t1, t2)
  }
  dense_name = f"dense (reference) T={t1}"
  dense = {
    dense_name: (fwd_bwd("reference", a.window, None), inputs(a.batch, t1, a.q_heads, a.kv_heads, a.head_dim, dtype))
  }
  # Dense first, then the two banded cases interleaved with each other only (dense's GB-sized temporaries
  # disturb the allocator and caches of whatever runs right after them).
  res = bench(dense, max(1, a.dense_reps))
  res.update(bench(band, a.reps))
  print(f"{'case':<26}{'median ms':>11}{'min ms':>10}{'cpu ms':>10}")
  for name, (med, mn, cp) in res.items():
    print(f"{name:<26}{med * 1e3:>11.1f}{mn * 1e3:>10.1f}{cp * 1e3:>10.1f}")
  dense, band1, band2 = res.values()
  print(
    f"dense / banded at T={t1}: {dense[0] / band1[0]:.2f}x median wall, {dense[1] / band1[1]:.2f}x min wall, "
    f"{dense[2] / band1[2]:.2f}x cpu   (goal >= 3)"
  )
  print(
    f"banded T={t2} / T={t1}: {band2[0] / band1[0]:.2f} median wall, {band2[1] / band1[1]:.2f} min wall, "
    f"{band2[2] / band1[2]:.2f} cpu   (goal <= 2.3)"
  )


if __name__ == "__main__":
  main()
