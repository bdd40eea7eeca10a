"""KV caches for the rollout engine: a full cache for full-attention layers, a ring buffer for sliding-window ones.

Per layer: {"k": [B, Hkv, S, D], "v": [B, Hkv, D, S] (the layouts attention's two products read), "pos": [B, S]
int32 (-1 = empty)}. S = the total length for full-attention layers and min(total, window + lookahead) for
sliding-window layers, so SWA memory is proportional to the window. `lookahead` (= the number of tokens written per
verify step minus one, e.g. 3 for MTP-3 drafts) keeps entries still in a query's window from being overwritten by
tokens written in the same call. The tree mirrors the parameter tree: layer_{i}, blocks/sub_{j} (stacked over
blocks) and mtp_{k}.

Storage dtype (`storage_dtype`, `init_cache`'s default): the model's dtype, except 16-bit values on a CPU backend,
which are kept in an fp32 cache. They are still 16-bit values (written from the layer's bf16 keys / values, exactly
representable) and the attention computes in fp32 anyway: the same tokens, log-probs equal to float rounding (the
dots read an fp32 buffer directly and a bf16 one through a conversion; tests/test_rollout.py). XLA:CPU writes a
token into a 16-bit buffer by converting the whole buffer to fp32 and back: 19x the time of an fp32 write on a
384 x 68 x 2 x 32 cache (2026-12-06; experiments/benchmarks/rollout.py 6).
"""

import jax
import jax.numpy as jnp

from stepflash_jax.config import LayerSpec, ModelArgs


def _layer_cache(a: ModelArgs, spec: LayerSpec, batch, length, lookahead, dtype, stack=None):
  S = length if spec.window is None else min(length, spec.window + lookahead)
  lead = () if stack is None else (stack,)
  return {
    "k": jnp.zeros(lead + (batch, a.num_kv_heads, S, a.head_dim), dtype),
    "v": jnp.zeros(lead + (batch, a.num_kv_heads, a.head_dim, S), dtype),
    "pos": jnp.full(lead + (batch, S), -1, jnp.int32),
  }


def storage_dtype(dtype) -> jnp.dtype:
  """The dtype a cache of `dtype` values is stored in: fp32 for 16-bit values on a CPU backend, else `dtype`."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if dtype.itemsize == 2 and jax.default_backend() == "cpu" else dtype


def init_cache(a: ModelArgs, batch: int, length: int, lookahead: int = 0, dtype=None, mtp: bool = False):
  """Empty caches for `batch` rows of at most `length` columns (prompt + generated), stored in `dtype` (default:
  `storage_dtype` of the model's dtype)."""
  dtype = dtype or storage_dtype(a.dtype)
  start, period, n = a.scan if a.scan else (len(a.layers), 0, 0)
  cache = {}
  for i, spec in enumerate(a.layers):
    if not start <= i < start + period * n:
      cache[f"layer_{i}"] = _layer_cache(a, spec, batch, length, lookahead, dtype)
  if n:
    cache["blocks"] = {
      f"sub_{j}": _layer_cache(a, a.layers[start + j], batch, length, lookahead, dtype, stack=n) for j in range(period)
    }
  if mtp:
    cache["mtp"] = [_layer_cache(a, s, batch, length, lookahead, dtype) for s in a.mtp_layers]
  return cache


def cache_bytes(cache) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
