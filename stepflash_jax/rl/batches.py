"""Host-side batches of a generation: prompts repeated per sample, the prompts kept by dynamic sampling, full training
sequences from the rollout engine's output, and the shuffled mini-batches of the update epoch."""

from __future__ import annotations

import numpy as np

from stepflash_jax import parallel
from stepflash_jax.rl import packing


def sequences(prompts, gen):
  """Prompt batch + engine output -> full sequences with positions and segment ids for the training engine, and
  the experts the rollout engine chose (router replay). `mask` (loss, ratios, values) is the engine's
  response_mask; segment ids mark every trajectory token (response_valid: tool outputs included)."""
  R = gen["response"].shape[1]
  mask = np.asarray(gen["response_mask"], np.float32)
  valid = np.asarray(gen.get("response_valid", mask))  # multi-turn: tool outputs are context, not loss
  pos_r = prompts["lengths"][:, None] + np.arange(R)[None]
  out = {
    "tokens": np.concatenate([prompts["tokens"], np.asarray(gen["response"])], 1).astype(np.int32),
    "positions": np.concatenate([prompts["positions"], pos_r], 1).astype(np.int32),
    "segment_ids": np.concatenate([prompts["segment_ids"], valid.astype(np.int32)], 1),
    "response": np.asarray(gen["response"], np.int32),
    "mask": mask,
    "logp_rollout": np.asarray(gen["logp"], np.float32),
  }
  if gen.get("expert_ids"):  # [n, MoE layers (sorted by name), P + R, k]: router replay (programs.experts_dict)
    out["rollout_experts"] = np.stack([np.asarray(gen["expert_ids"][k]) for k in sorted(gen["expert_ids"])], 1)
  return out


def repeat_prompts(batch, n):
  """Each prompt row (and its example) repeated n times in a row: [P rows] -> [P * n rows]."""
  out = {k: np.repeat(v, n, axis=0) for k, v in batch.items() if k != "examples"}
  out["examples"] = [ex for ex in batch["examples"] for _ in range(n)]
  return out


def minibatches(batch, n, rng, mesh, rules, pack: float = 0.0):
  """`n` mini-batches of a generation's rows, one random permutation split evenly (placed on the mesh); each
  packed (rl/packing.py) when `pack` > 0 and its sequences fit."""
  perm = rng.permutation(len(batch["mask"]))
  for idx in np.array_split(perm, n):
    mb = packing.add({k: v[idx] for k, v in batch.items()}, pack)
    yield parallel.shard_batch(mb, mesh, rules, global_batch=True)


def reward_spread(reward, samples: int) -> np.ndarray:
  """Rewards [G * samples] of G prompts' groups (consecutive rows) -> each group's population variance [G]
  (p (1 - p) for 0/1 rewards)."""
  return np.asarray(reward, np.float64).reshape(-1, samples).var(1)


def informative_rows(spread, samples: int, keep: int, rng) -> np.ndarray:
  """Dynamic sampling (docs/rl.md §1, step 0): reward_spread [G] -> the row indices of the `keep` groups whose
  rewards vary most, ties broken at random by the NumPy Generator `rng`, in their original order."""
  if not 0 < keep <= len(spread):
    raise ValueError(f"keep must be in [1, {len(spread)}] (the groups sampled), got {keep}")
  order = np.lexsort((rng.random(len(spread)), -np.asarray(spread)))  # largest first; random among equal ones
  groups = np.sort(order[:keep])
  return (groups[:, None] * samples + np.arange(samples)).ravel()


def take_rows(tree, rows, n: int):
  """The rows `rows` of every array (or list) with `n` rows in a nested dict; other leaves (scalars, per-generation
  statistics) unchanged."""
  if isinstance(tree, dict):
    return {k: take_rows(v, rows, n) for k, v in tree.items()}
  if isinstance(tree, list):
    return [tree[i] for i in rows] if len(tree) == n else tree
  if getattr(tree, "ndim", 0) >= 1 and tree.shape[0] == n:
    return np.asarray(tree)[rows]
  return tree
