"""Plain (one token per step) decoding: prefill, then a lax.while_loop of decode steps (layout: engine.py)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from stepflash_jax.config import ModelArgs
from stepflash_jax.model.cache import init_cache
from stepflash_jax.sampling.calls import cast_variables, empty_expert_ids, model_call, record_expert_ids
from stepflash_jax.sampling.sample import draw, is_stop, noisy, sampling_logprobs


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What a compiled generation program is specialised on (hashable: the jit cache key)."""

  args: ModelArgs  # the model, in the engine's dtype
  max_prompt_len: int  # P: prompts are left-padded to P columns
  max_new_tokens: int  # N: response slots
  quantize: str | None = None  # weight quantization of the engine: None | "int8" | "fp8" (sampling/quantize.py)


class Sampling(NamedTuple):
  """Traced scalars of a generation (engines that differ only in these share one compiled program)."""

  temperature: jax.Array  # float32; <= 0: greedy
  top_p: jax.Array  # float32 in (0, 1]
  noise: jax.Array  # float32: std of Gaussian noise added to the logits (mismatch lab)
  eos_id: jax.Array  # int32 scalar or [S]: the stop tokens (EOS first; multi-turn adds the tool-call end)
  pad_id: jax.Array  # int32


def prefill_inputs(st, lens):
  """-> pad [B], positions [B, P] (0 at a row's first real token; pad columns get 0 but segment 0), segments."""
  col = jnp.arange(st.max_prompt_len)[None]
  pad = st.max_prompt_len - lens
  return pad, jnp.maximum(col - pad[:, None], 0), (col >= pad[:, None]).astype(jnp.int32)


def result(st, eos, prompts, resp, logp, mask, conf, ntok, conf_p, ids):
  has_eos = jnp.any(is_stop(resp, eos) & (mask > 0), axis=1)
  T = st.max_prompt_len + st.max_new_tokens
  return {
    "expert_ids": {k: x[:, :T] for k, x in ids.items()},
    "tokens": jnp.concatenate([prompts, resp], 1),
    "response": resp,
    "response_mask": mask,
    "logp": logp * mask,
    "lengths": mask.sum(1).astype(jnp.int32),
    "truncated": ~has_eos,
    "routing_confidence": layer_mean(conf) / jnp.maximum(ntok, 1.0),
    "routing_confidence_layers": {k: c / jnp.maximum(ntok, 1.0) for k, c in conf.items()},
    "routing_confidence_prompt": layer_mean(conf_p),
  }


def layer_mean(conf: dict):
  return jnp.mean(jnp.stack(list(conf.values()))) if conf else jnp.float32(0)


def accumulate(total: dict, conf: dict, ntok):
  """Token-weighted running sum of the per-layer routing confidence of the decode calls."""
  return {k: total[k] + conf[k] * ntok for k in total}


def generate_plain(st: Shapes, variables, prompts, lens, sampling: Sampling, rng):
  a, P, N = st.args, st.max_prompt_len, st.max_new_tokens
  temp, top_p, noise, eos, pad_id = sampling
  B = prompts.shape[0]
  v = cast_variables(variables, a.dtype, st.quantize)
  _, pos, seg = prefill_inputs(st, lens)
  logits, _, cache, conf_p, _, ids = model_call(a, v, prompts, pos, seg, init_cache(a, B, P + N), 0)

  def sample(i, logits):
    kn, ks = jax.random.split(jax.random.fold_in(rng, i))
    return draw(ks, sampling_logprobs(noisy(kn, logits, noise), temp, top_p), temp <= 0)

  tok, lp = sample(0, logits[:, -1])
  s = dict(
    i=jnp.int32(1),
    cache=cache,
    done=is_stop(tok, eos),
    conf=jax.tree.map(jnp.zeros_like, conf_p),
    ntok=jnp.float32(0),
    ids=record_expert_ids(empty_expert_ids(a, B, P + N), ids, 0),
    resp=jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(tok),
    logp=jnp.zeros((B, N), jnp.float32).at[:, 0].set(lp),
    mask=jnp.zeros((B, N), jnp.float32).at[:, 0].set(1.0),
  )

  def body(s):
    i, active = s["i"], ~s["done"]
    tok_in = lax.dynamic_slice_in_dim(s["resp"], i - 1, 1, axis=1)
    logits, _, cache, conf, ntok, ids = model_call(
      a, v, tok_in, (lens + i - 1)[:, None], active[:, None].astype(jnp.int32), s["cache"], P + i - 1
    )
    tok, lp = sample(i, logits[:, 0])
    tok = jnp.where(active, tok, pad_id)
    put = lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x[:, None].astype(buf.dtype), i, axis=1)
    return dict(
      i=i + 1,
      cache=cache,
      done=s["done"] | (active & is_stop(tok, eos)),
      conf=accumulate(s["conf"], conf, ntok),
      ntok=s["ntok"] + ntok,
      ids=record_expert_ids(s["ids"], ids, P + i - 1),
      resp=put(s["resp"], tok),
      logp=put(s["logp"], jnp.where(active, lp, 0.0)),
      mask=put(s["mask"], active.astype(jnp.float32)),
    )

  s = lax.while_loop(lambda s: (s["i"] < N) & ~jnp.all(s["done"]), body, s)
  return result(st, eos, prompts, s["resp"], s["logp"], s["mask"], s["conf"], s["ntok"], conf_p, s["ids"])
