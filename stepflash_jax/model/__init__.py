"""Model entry points: build, init, apply, and the logical-axis tree of the parameters.

Variables are a plain dict pytree {"params": ..., "router": ...}: "params" carries gradients, "router" holds the
MoE selection biases (updated by the aux-loss-free rule, never by gradients).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import config as config_lib
from stepflash_jax import ops
from stepflash_jax.config import ModelArgs
from stepflash_jax.model import replay as replay_lib
from stepflash_jax.model.cache import init_cache
from stepflash_jax.model.transformer import Transformer

COLLECTIONS = ("params", "router")


def as_args(cfg) -> ModelArgs:
  return cfg if isinstance(cfg, ModelArgs) else config_lib.model_args(cfg)


def build(cfg, head: str = "lm") -> Transformer:
  return Transformer(as_args(cfg), head=head)


def _boxed_init(cfg, rng, head):
  tokens = jnp.zeros((1, 4), jnp.int32)
  v = build(cfg, head).init(rng, tokens, mtp=(head == "lm"))
  return {k: v[k] for k in COLLECTIONS if k in v}


def init(cfg, rng, head: str = "lm"):
  """Random variables {"params", "router"}: normal(init_std) weights; norm scales, router biases and the value
  head zero. Drawn leaf by leaf from the abstract shapes (no trace of the forward pass, so it compiles fast)."""
  args = as_args(cfg)
  abstract = abstract_variables(args, head)
  paths, tree = jax.tree_util.tree_flatten_with_path(abstract)

  def sample(rng):  # one random draw sliced into leaves: compiles in a fraction of a second
    sizes = [x.size for _, x in paths]
    flat = args.init_std * jax.random.normal(rng, (sum(sizes),), jnp.float32)
    out, off = [], 0
    for (path, x), n in zip(paths, sizes):
      names = [getattr(p, "key", "") for p in path]
      zero = names[-1] in ("scale", "router_bias") or "value_head" in names
      out.append(jnp.zeros(x.shape, x.dtype) if zero else flat[off : off + n].reshape(x.shape).astype(x.dtype))
      off += n
    return jax.tree.unflatten(tree, out)

  return jax.jit(sample)(rng)


def abstract_variables(cfg, head: str = "lm"):
  """ShapeDtypeStructs of the variables without allocating anything."""
  args = as_args(cfg)
  return nn.meta.unbox(jax.eval_shape(lambda: _boxed_init(args, jax.random.key(0), head)))


def logical_axes(cfg, head: str = "lm"):
  """The logical axis names of every variable, as a tree of jax.sharding.PartitionSpec."""
  args = as_args(cfg)
  return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(args, jax.random.key(0), head)))


def apply(
  cfg,
  variables,
  tokens,
  *,
  positions=None,
  segment_ids=None,
  mtp=False,
  head="lm",
  stats=False,
  cache=None,
  cache_index=None,
  replay_experts=None,
  logits=True,
):
  """Run the model. Returns the output dict (and, if stats=True, the sown "moe_stats" tree plus
  stats["expert_ids"] = {MoE layer name: int32 [B, T, k]}, the experts each layer chose). logits=False: no logits,
  each head's (normed hidden, weight) as out["heads"] instead (`Transformer`, `head_logprobs`).

  replay_experts: such a dict (router replay, model/replay.py): every MoE layer of the main model uses the given
  experts instead of its top-k; the routing weights still come from the current router. MTP layers are not replayed.
  Concrete (not traced) tokens are checked: ids outside [0, vocab_size) or an empty sequence raise ValueError."""
  args = as_args(cfg)
  check_tokens(tokens, args.vocab_size, "apply")
  replay = None if replay_experts is None else replay_lib.replay_tree(args, replay_experts, np.shape(tokens))
  model = build(args, head)
  variables = {k: variables[k] for k in COLLECTIONS if k in variables}
  call = (variables, tokens, positions, segment_ids, cache, cache_index, mtp, replay, logits)
  if stats:
    out, st = model.apply(*call, mutable=["moe_stats"])
    st = dict(st.get("moe_stats", {}))
    return out, {**st, "expert_ids": replay_lib.expert_ids(st)}
  return model.apply(*call)


def head_logprobs(head, targets, temperature: float = 1.0):
  """head = (normed [B, T, H], weight [H, V]) (apply(..., logits=False)["heads"][k]), targets int [B, T] ->
  (logp, lse, entropy), each float32 [B, T], of softmax(logits / temperature), computed chunk by chunk over the
  vocabulary (`ops.token_logprobs`: the [B, T, V] logits are never materialised, forward or backward)."""
  hn, w = head
  B, T, H = hn.shape
  if temperature != 1.0:
    hn, w = hn.astype(jnp.float32), w.astype(jnp.float32) / temperature  # logits / t = h (W / t)
  out = ops.token_logprobs(hn.reshape(B * T, H), w, targets.reshape(B * T))
  return tuple(x.reshape(B, T) for x in out)


@functools.lru_cache(maxsize=None)
def _jit_logits(args):
  return jax.jit(lambda v, t: apply(args, v, t)["logits"])


def check_tokens(tokens, vocab_size: int, fn: str = "apply") -> None:
  """ValueError for an empty batch / sequence (B or T = 0) and, when the ids are concrete (NumPy or a fully
  addressable jax.Array, not a tracer under jit), for ids outside [0, vocab_size): out-of-range ids would give NaN
  logits (ids >= vocab_size) or silently wrap around (negative ids)."""
  shape = tuple(np.shape(tokens))
  if len(shape) == 2 and 0 in shape:
    raise ValueError(f"{fn}: empty input, tokens shape {shape} (need B >= 1 and T >= 1 tokens)")
  if isinstance(tokens, jax.core.Tracer) or (isinstance(tokens, jax.Array) and not tokens.is_fully_addressable):
    return
  ids = np.asarray(tokens)
  if ids.size and np.issubdtype(ids.dtype, np.integer) and (ids.min() < 0 or ids.max() >= vocab_size):
    n_bad = int(((ids < 0) | (ids >= vocab_size)).sum())
    raise ValueError(
      f"{fn}: token ids must lie in [0, {vocab_size}) (vocab_size), got ids in [{ids.min()}, {ids.max()}] "
      f"({n_bad} of {ids.size} out of range)"
    )


def forward(cfg, params, input_ids):
  """int32 [B, T] -> float32 [B, T, vocab] logits of the main head (compute dtype from the config).

  Raises ValueError for ids outside [0, vocab_size) and for an empty sequence (T = 0) or batch (B = 0)."""
  input_ids = jnp.asarray(input_ids)
  if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
    raise ValueError(f"input_ids must be an integer array [B, T], got {input_ids.dtype} {input_ids.shape}")
  check_tokens(input_ids, as_args(cfg).vocab_size, "forward")
  return _jit_logits(as_args(cfg))(params, input_ids.astype(jnp.int32))
