"""MoE expert FFN with ops.grouped_matmul ("xla" tiled) vs jax.lax.ragged_dot, fwd+bwd, on the current backend.

    python experiments/benchmarks/moe.py [--tokens 4096 --hidden 128 --expert_width 256 --experts 64 --top_k 2]

The FFN (docs/architecture.md §5, without shared expert / clamp / router bias): sigmoid router scores, top-k,
combine weights = chosen scores renormalised; tokens sorted by expert, SwiGLU experts down(silu(x gate) * (x up))
as three grouped matmuls, unsort, weighted combine. Prints a table and two ratios:
  ragged_dot / ours at E experts          (goal >= 4: on CPU ragged_dot costs as much as running all experts)
  ours(E) / ours(E_small) at equal tokens  (goal <= 1.6: cost follows active rows, not experts)
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from stepflash_jax import ops
from timing import bench  # experiments/benchmarks/timing.py (the script's folder is on sys.path)


def init(key, hidden, width, experts, dtype):
  kr, kg, ku, kd = jax.random.split(key, 4)
  return {
    "router": jax.random.normal(kr, (hidden, experts), jnp.float32) * hidden**-0.5,
    "gate": (jax.random.normal(kg, (experts, hidden, width)) * hidden**-0.5).astype(dtype),
    "up": (jax.random.normal(ku, (experts, hidden, width)) * hidden**-0.5).astype(dtype),
    "down": (jax.random.normal(kd, (experts, width, hidden)) * width**-0.5).astype(dtype),
  }


def moe_ffn(params, x, *, top_k, gmm):
  """x [T, H] -> [T, H]; gmm(lhs [M, K], rhs [E, K, N], group_sizes [E]) -> [M, N]."""
  t, _ = x.shape
  e = params["router"].shape[1]
  scores = jax.nn.sigmoid(x.astype(jnp.float32) @ params["router"])  # [T, E], fp32
  w, idx = jax.lax.top_k(scores, top_k)  # [T, k]
  w = w / jnp.sum(w, axis=-1, keepdims=True)
  flat = idx.reshape(-1)  # [T * k], slot s belongs to token s // k
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  xs = x[order // top_k]  # [T * k, H] sorted by expert
  h = jax.nn.silu(gmm(xs, params["gate"], group_sizes)) * gmm(xs, params["up"], group_sizes)
  ys = gmm(h, params["down"], group_sizes)  # [T * k, H]
  y = jnp.zeros_like(ys).at[order].set(ys).reshape(t, top_k, -1)  # unsort
  return jnp.einsum("tk,tkh->th", w.astype(y.dtype), y)


def ours(lhs, rhs, group_sizes, tile_m=None):
  return ops.grouped_matmul(lhs, rhs, group_sizes, implementation="xla", tile_m=tile_m)


def ragged(lhs, rhs, group_sizes):
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)


def make_step(gmm, top_k):
  def loss(params, x):
    return jnp.sum(moe_ffn(params, x, top_k=top_k, gmm=gmm).astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--expert_width", type=int, default=256)
  ap.add_argument("--experts", type=int, default=64)
  ap.add_argument("--experts_small", type=int, default=8)
  ap.add_argument("--top_k", type=int, default=2)
  ap.add_argument("--tile_m", type=int, default=None, help="row tile of ours (default: the op's choice)")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--ragged_reps", type=int, default=3, help="ragged_dot is slow on CPU; fewer reps")
  a = ap.parse_args()
  dtype = jnp.dtype(a.dtype)
  print(
    f"backend={jax.default_backend()} tokens={a.tokens} hidden={a.hidden} expert_width={a.expert_width} "
    f"top_k={a.top_k} dtype={dtype.name} tile_m={a.tile_m or 'default'}; fwd+bwd (grads of x and all "
    f"weights), {a.reps} reps ({a.ragged_reps} ragged_dot)"
  )

  x = jax.random.normal(jax.random.PRNGKey(0), (a.tokens, a.hidden), dtype)
  p_big = init(jax.random.PRNGKey(1), a.hidden, a.expert_width, a.experts, dtype)
  p_small = init(jax.random.PRNGKey(2), a.hidden, a.expert_width, a.experts_small, dtype)
  gmm = functools.partial(ours, tile_m=a.tile_m)
  ours_cases = {
    f"ours (xla) E={a.experts}": (make_step(gmm, a.top_k), (p_big, x)),
    f"ours (xla) E={a.experts_small}": (make_step(gmm, a.top_k), (p_small, x)),
  }
  res = bench(ours_cases, a.reps)  # interleaved with each other only: ragged_dot's GB-sized temporaries
  name = f"ragged_dot E={a.experts}"  # would disturb them (allocator / page cache state) if interleaved
  res[name] = bench({name: (make_step(ragged, a.top_k), (p_big, x))}, max(1, a.ragged_reps))[name]
  print(f"{'case':<24}{'median ms':>11}{'min ms':>10}{'cpu ms':>10}")
  for name, (med, mn, cp) in res.items():
    print(f"{name:<24}{med * 1e3:>11.1f}{mn * 1e3:>10.1f}{cp * 1e3:>10.1f}")
  big, small, rag = res.values()
  print(
    f"ragged_dot / ours at E={a.experts}: {rag[0] / big[0]:.2f}x median wall, {rag[1] / big[1]:.2f}x min wall,"
    f" {rag[2] / big[2]:.2f}x cpu   (goal >= 4)"
  )
  print(
    f"ours E={a.experts} / E={a.experts_small}: {big[0] / small[0]:.2f} median wall, {big[1] / small[1]:.2f} min "
    f"wall, {big[2] / small[2]:.2f} cpu   (goal <= 1.6)"
  )


if __name__ == "__main__":
  main()
