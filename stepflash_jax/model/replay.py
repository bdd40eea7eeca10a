"""Router replay (docs/architecture.md §5): the experts an MoE layer chose, by layer name, and the same ids fed back.

A forward pass with `stats=True` sows each MoE layer's chosen experts, int32 [B, T, k]. `expert_ids(args, stats)`
names them as `stat_layers` names scalars: "layer_3" for an unrolled layer, "blocks/sub_j[b]" for sub-layer j of
scanned block b ("mtp_i/layer" for MTP layers when they ran). `replay_tree(args, ids, shape)` checks such a dict
and arranges it as the model's layers take it: the selection top_k(s + bias) is replaced by the given experts, while
the weights w = s[chosen] / sum s[chosen] still come from the current router (so gradients reach it). MTP layers
are never replayed: their entries are ignored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax.config import ModelArgs


def moe_layer_names(args: ModelArgs) -> list[str]:
  """Names of the main model's MoE layers, in layer order."""
  start, period, n = args.scan if args.scan else (len(args.layers), 0, 0)
  names = []
  for i, spec in enumerate(args.layers):
    if not spec.moe:
      continue
    if start <= i < start + period * n:
      names.append(f"blocks/sub_{(i - start) % period}[{(i - start) // period}]")
    else:
      names.append(f"layer_{i}")
  return names


def expert_ids(stats) -> dict:
  """{MoE layer name: int32 [B, T, k]} from a sown "moe_stats" tree (scanned stacks split per block)."""
  out = {}
  for path, v in jax.tree_util.tree_flatten_with_path(stats, is_leaf=lambda x: isinstance(x, tuple))[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-1] != "expert_ids":
      continue
    where, ids = "/".join(k for k in keys[:-1] if k != "moe"), v[0]
    out.update({where: ids} if ids.ndim == 3 else {f"{where}[{b}]": ids[b] for b in range(ids.shape[0])})
  return out


def replay_tree(args: ModelArgs, ids, shape) -> dict:
  """Check a replay dict {name: int [B, T, k]} against the model and the tokens' shape (B, T); return it arranged
  as `Transformer` takes it: {"layer_i": [B, T, k], "blocks": {"sub_j": [n_blocks, B, T, k]}} (int32).

  ValueError naming the entry for a missing or unknown layer, a wrong shape, a non-integer dtype or (for concrete
  arrays) ids outside [0, num_experts)."""
  if not isinstance(ids, dict):
    raise ValueError(f"replay_experts must be a dict {{MoE layer name: int [B, T, k]}}, got {type(ids).__name__}")
  names = moe_layer_names(args)
  given = {k: v for k, v in ids.items() if not str(k).startswith("mtp_")}  # MTP layers are not replayed
  missing, unknown = [k for k in names if k not in given], sorted(set(given) - set(names))
  if missing or unknown:
    raise ValueError(f"replay_experts: missing MoE layers {missing}, unknown entries {unknown}; expected {names}")
  want = (*shape, args.top_k)
  for name in names:
    x = given[name]
    if tuple(np.shape(x)) != want or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(
        f"replay_experts[{name!r}] must be an integer array of shape {want} ([B, T, num_experts_per_tok]), "
        f"got {jnp.result_type(x)} {tuple(np.shape(x))}"
      )
    if not isinstance(x, jax.core.Tracer) and (not isinstance(x, jax.Array) or x.is_fully_addressable):
      a = np.asarray(x)
      if a.size and (a.min() < 0 or a.max() >= args.num_experts):
        raise ValueError(
          f"replay_experts[{name!r}]: expert ids must lie in [0, {args.num_experts}), got [{a.min()}, {a.max()}]"
        )
  tree = {"blocks": {}}
  for name in names:
    x = jnp.asarray(given[name], jnp.int32)
    if name.startswith("blocks/"):
      tree["blocks"].setdefault(name[len("blocks/") :].split("[")[0], []).append(x)
    else:
      tree[name] = x
  tree["blocks"] = {k: jnp.stack(v) for k, v in tree["blocks"].items()}
  return tree
