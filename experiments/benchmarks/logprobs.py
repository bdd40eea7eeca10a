"""Memory of the LM head's log-probs: full [N, V] fp32 logits vs ops.token_logprobs' vocabulary chunks.

    python experiments/benchmarks/logprobs.py [--tokens 4096 --vocab 128896 --hidden 256 --chunk 8192]

Compiles (does not run) the forward + backward of sum(logp + lse + entropy) both ways and prints XLA's temporary
buffer size (`compiled.memory_analysis().temp_size_in_bytes`) and the ratio full / chunked. The defaults are the
real vocabulary (128,896) at 4,096 tokens; the hidden size only scales h and W, not the [N, V] block, so a small
one keeps the compile quick (goal: chunked <= 1/8 of full).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from stepflash_jax.ops import token_logprobs


def temp_bytes(tokens: int, vocab: int, hidden: int, implementation: str, chunk: int | None) -> int:
  """XLA's temporary bytes for grad(sum of logp, lse, entropy) w.r.t. (h, W) at these shapes."""

  def objective(h, w, t):
    logp, lse, ent = token_logprobs(h, w, t, implementation=implementation, chunk_size=chunk)
    return jnp.sum(logp + lse + ent)

  shapes = (
    jax.ShapeDtypeStruct((tokens, hidden), jnp.float32),
    jax.ShapeDtypeStruct((hidden, vocab), jnp.float32),
    jax.ShapeDtypeStruct((tokens,), jnp.int32),
  )
  compiled = jax.jit(jax.grad(objective, argnums=(0, 1))).lower(*shapes).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=128896)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--chunk", type=int, default=8192)
  a = p.parse_args()
  full = temp_bytes(a.tokens, a.vocab, a.hidden, "reference", None)
  chunked = temp_bytes(a.tokens, a.vocab, a.hidden, "chunked", a.chunk)
  print(f"{a.tokens} tokens x vocab {a.vocab}, hidden {a.hidden}, fwd+bwd temp memory ({jax.default_backend()}):")
  print(f"  full logits   {full / 2**20:10.1f} MiB")
  print(f"  chunked {a.chunk:5d} {chunked / 2**20:10.1f} MiB")
  print(f"  full / chunked = {full / chunked:.1f}x (goal >= 8)")


if __name__ == "__main__":
  main()
