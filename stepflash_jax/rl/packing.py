"""Sequence packing for the RL model passes (docs/rl.md §1.7).

A generation's sequences sit in [n, T = P + R] slots: prompts left-padded to P, responses padded to R. On the main
job ~40% of those slots are padding. `add` places each sequence's span (first to last token with a segment id > 0)
first-fit, longest first, into `rows` rows of W = 4T slots (wide rows: the bins fill well even at 16 sequences),
each sequence with its own segment id in its row and its own positions; the model sees the same tokens, positions
and visibility (attention never crosses segments), so every real token's output is the unpacked one. `unpack`
gathers outputs back to [n, T], so losses, advantages and metrics are unchanged. Slots outside every span read and
give zeros.

Host fields added to a batch (numpy int32): pack_src [rows, W] (flat index n * t + col of the unpacked slot each
packed slot holds; n * T = empty), pack_seg [rows, W] (1, 2, ... per sequence in the row; 0 = empty), pack_dest
[n, T] (flat index of the packed slot holding each unpacked slot; rows * W = none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

FIELDS = ("pack_src", "pack_seg", "pack_dest")


ROW = 4  # sequence slots per packed row: W = ROW * T


def plan(segment_ids: np.ndarray, rows: int) -> dict | None:
  """First-fit-decreasing placement of the sequences of segment_ids [n, T] into `rows` rows of ROW * T slots; None
  when they do not fit."""
  seg = np.asarray(segment_ids)
  n, T = seg.shape
  W = ROW * T
  real = seg > 0
  first = np.where(real.any(1), real.argmax(1), 0)
  length = np.where(real.any(1), T - real[:, ::-1].argmax(1) - first, 0)
  src = np.full((rows, W), n * T, np.int32)
  pseg = np.zeros((rows, W), np.int32)
  dest = np.full((n, T), rows * W, np.int32)
  fill, count = np.zeros(rows, np.int64), np.zeros(rows, np.int32)
  for i in np.argsort(-length, kind="stable"):
    k = int(length[i])
    if k == 0:
      continue
    free = np.nonzero(fill + k <= W)[0]
    if not len(free):
      return None
    r, c, f = free[0], fill[free[0]], first[i]
    count[r] += 1
    src[r, c : c + k] = i * T + f + np.arange(k)
    pseg[r, c : c + k] = np.where(real[i, f : f + k], count[r], 0)
    dest[i, f : f + k] = r * W + c + np.arange(k)
    fill[r] += k
  return {"pack_src": src, "pack_seg": pseg, "pack_dest": dest}


def add(batch: dict, fraction: float) -> dict:
  """batch with the packing fields for ceil(fraction * n / ROW) rows of ROW * T slots (fraction of the unpacked slots);
  the batch itself when fraction is 0 or the sequences do not fit (the caller runs the unpacked program)."""
  if not fraction:
    return batch
  n = batch["segment_ids"].shape[0]
  fields = plan(batch["segment_ids"], max(1, math.ceil(fraction * n / ROW)))
  return batch if fields is None else {**batch, **fields}


def packed(mb) -> bool:
  return "pack_src" in mb


def pack(x, mb):
  """[n, T, ...] -> [rows, W, ...] (empty slots 0)."""
  flat = x.reshape(-1, *x.shape[2:])
  flat = jnp.concatenate([flat, jnp.zeros((1, *flat.shape[1:]), flat.dtype)])
  return flat[mb["pack_src"]]


def unpack(x, mb, axis: int = 0):
  """x with [rows, W] at axes (axis, axis + 1) -> [n, T] there (slots no sequence covers: 0)."""
  rows_w = x.shape[axis] * x.shape[axis + 1]
  flat = x.reshape(*x.shape[:axis], rows_w, *x.shape[axis + 2 :])
  zero = jnp.zeros((*flat.shape[:axis], 1, *flat.shape[axis + 1 :]), flat.dtype)
  flat = jnp.concatenate([flat, zero], axis)
  return jnp.take(flat, mb["pack_dest"], axis=axis)


def inputs(mb):
  """(tokens, positions, segment_ids) for the model: packed [rows, W] when mb carries the packing, else as is."""
  if not packed(mb):
    return mb["tokens"], mb["positions"], mb["segment_ids"]
  return pack(mb["tokens"], mb), pack(mb["positions"], mb), mb["pack_seg"]


def unpack_stats(stats, mb):
  """The per-token MoE statistics of a packed pass ("confidence_per_token" [..., rows, W], "expert_ids" [..., rows,
  W, k]) back to [..., n, T(, k)]; batch aggregates are left as they are (they cover the same real tokens)."""
  if not packed(mb):
    return stats

  def walk(tree, name=""):
    if isinstance(tree, Mapping):
      return {k: walk(v, k if k in ("confidence_per_token", "expert_ids") else name) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
      return type(tree)(walk(v, name) for v in tree)
    if name == "confidence_per_token":
      return unpack(tree, mb, tree.ndim - 2)
    if name == "expert_ids":
      return unpack(tree, mb, tree.ndim - 3)
    return tree

  return walk(stats)
