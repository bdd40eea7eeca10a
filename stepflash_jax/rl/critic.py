"""The critic (docs/rl.md §6): the same backbone with a scalar value head, initialised from the SFT checkpoint.

values_all[b, p] = V(state after consuming tokens 0..p). For a response starting at column P (prompt length after
left padding), V(s_t) of response token t is values_all[:, P - 1 + t]; V(s_T) after the last token is the next
column. `response_values` returns [B, R + 1] in that convention (what `gae_advantages` expects).
"""

import jax.numpy as jnp

from stepflash_jax import model as model_lib
from stepflash_jax.rl import packing


def critic_from_actor(actor_variables):
  """Backbone params copied from the actor (no lm_head, no MTP) + a zero value head; the same router biases."""
  p = actor_variables["params"]
  params = {k: v for k, v in p.items() if k != "lm_head" and not k.startswith("mtp_")}
  params["value_head"] = {"kernel": jnp.zeros((p["final_norm"]["scale"].shape[-1],), jnp.float32)}
  return {"params": params, "router": actor_variables["router"]}


def response_values(args, variables, mb, prompt_len: int):
  """mb["tokens"] [B, P + R] (with mb["positions"], mb["segment_ids"], packed or not: rl/packing.py) -> V(s_t)
  for t = 0..R as float32 [B, R + 1]."""
  tokens, positions, segment_ids = packing.inputs(mb)
  v = model_lib.apply(args, variables, tokens, positions=positions, segment_ids=segment_ids, head="value")["values"]
  if packing.packed(mb):
    v = packing.unpack(v, mb)
  return v[:, prompt_len - 1 :]
