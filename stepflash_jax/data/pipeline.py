"""grain input pipelines: packed SFT batches and prompt streams for RL, generated on the fly from seeds.

Stream of examples (both pipelines):
    MapDataset.range(num_examples).shuffle(seed).repeat(num_epochs).map(index -> example)
  example i = tasks.sample_example(mixture, data_seed, i, split): the problem set is fixed by `data_seed`,
  the order by `seed` (reshuffled every epoch). No worker processes or threads by default (num_threads=0).

SFT (sft_dataset): each example -> ids x [T] and loss mask m [T]; form="chat" (SFT): the chat template
(tokenizer.format_example), m = 1 on the assistant's tokens; form="text" (pre-training corpus): plain text
[bos] prompt "\n" answer [eos], m = 1 everywhere. One document = (inputs x[:-1], targets x[1:], loss_mask m[1:]),
so a target never belongs to another document.
Documents are packed by grain's FirstFitPackIterDataset into rows of seq_len tokens and batched:
    tokens      [B, L] int32    input ids, 0 on padding (whatever the tokenizer's pad id: segment_ids mask it)
    targets     [B, L] int32    next token of the same document, 0 on padding
    loss_mask   [B, L] float32  1 where the target is trained on (chat: answer + eos; text: every token), 0 on padding
    segment_ids [B, L] int32    1..n for the n documents of a row, 0 on padding
    positions   [B, L] int32    0, 1, ... restarting at every document, 0 on padding
The model must restrict attention to equal segment_ids (ops.sliding_window_attention(segment_ids=...)) and
use `positions` for RoPE.

RL (prompt_dataset): batches of
    tokens      [B, P] int32    format_prompt ids, padded with pad_id to P = max_prompt_len, LEFT-padded by
                                default (pad_side="left": every prompt ends at column P-1, generation appends
                                at column P for the whole batch); pad_side="right" puts padding at the end
    lengths     [B] int32       number of real prompt tokens
    segment_ids [B, P] int32    1 on real tokens, 0 on padding (generated tokens continue with segment 1)
    positions   [B, P] int32    0..length-1 on real tokens, 0 on padding
    examples    list of B example dicts (prompt, answer, family, difficulty, metadata) for the reward checker
Iterators of both are grain DatasetIterators: get_state() / set_state() restore the exact stream.
"""

from __future__ import annotations

from typing import Any, Sequence

import grain
import numpy as np

from stepflash_jax.checks import is_int
from stepflash_jax.data import tasks
from stepflash_jax.data.tokenizer import Tokenizer

DEFAULT_NUM_EXAMPLES = 2**20  # problems per epoch


def _check_positive(name: str, value: Any) -> int:
  if not is_int(value) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def example_dataset(
  *,
  mixture: str | Sequence[tasks.MixtureComponent] = "default",
  split: str = "train",
  seed: int = 0,
  data_seed: int | None = None,
  num_examples: int = DEFAULT_NUM_EXAMPLES,
  num_epochs: int | None = None,
  shuffle: bool = True,
  examples: Sequence[dict] | None = None,
) -> grain.MapDataset:
  """MapDataset of example dicts. data_seed (default = seed) fixes the problems, seed (0..2**32-1) the order.
  num_epochs None = infinite. `examples` (e.g. a user's JSONL file, data/jsonl.py) replaces the generated
  problems: the mixture, split and num_examples are then unused."""
  tasks.base.check_split(split)
  _check_positive("num_examples", num_examples)
  if num_epochs is not None:
    _check_positive("num_epochs", num_epochs)
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}")
  if examples is not None:
    if not examples:
      raise ValueError("examples must be a non-empty list of example dicts")
    ds = grain.MapDataset.source(list(examples))
    return (ds.shuffle(seed) if shuffle else ds).repeat(num_epochs)
  mix = tasks.parse_mixture(mixture)
  data_seed = seed if data_seed is None else data_seed
  ds = grain.MapDataset.range(num_examples)
  if shuffle:
    ds = ds.shuffle(seed)
  ds = ds.repeat(num_epochs)
  return ds.map(lambda i: tasks.sample_example(mix, data_seed, int(i), split))


def _read_options(num_threads: int) -> grain.ReadOptions:
  return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * num_threads)


FORMS = ("chat", "text")


def document(tokenizer: Tokenizer, example: dict, seq_len: int, form: str = "chat") -> dict:
  """One packable document: inputs / targets / loss_mask, each [T-1] (see module docstring)."""
  if form == "chat":
    ids, mask = tokenizer.format_example(example["prompt"], example["answer"])
  else:
    ids = np.asarray([tokenizer.bos_id] + tokenizer.encode(f"{example['prompt']}\n{example['answer']}"), np.int32)
    ids = np.append(ids, np.int32(tokenizer.eos_id))
    mask = np.ones(len(ids), np.float32)
  if len(ids) - 1 > seq_len:
    raise ValueError(
      f"seq_len={seq_len} is shorter than an example ({len(ids) - 1} tokens after the shift): "
      f"{example['family']} difficulty {example['difficulty']}; raise seq_len"
    )
  return {"inputs": ids[:-1], "targets": ids[1:], "loss_mask": mask[1:]}


def _collate_packed(rows: Sequence[dict]) -> dict:
  return {
    "tokens": np.stack([r["inputs"] for r in rows]).astype(np.int32),
    "targets": np.stack([r["targets"] for r in rows]).astype(np.int32),
    "loss_mask": np.stack([r["loss_mask"] for r in rows]).astype(np.float32),
    "segment_ids": np.stack([r["inputs_segment_ids"] for r in rows]).astype(np.int32),
    "positions": np.stack([r["inputs_positions"] for r in rows]).astype(np.int32),
  }


def sft_dataset(
  tokenizer: Tokenizer,
  *,
  batch_size: int,
  seq_len: int,
  mixture: str | Sequence[tasks.MixtureComponent] = "default",
  split: str = "train",
  seed: int = 0,
  data_seed: int | None = None,
  num_examples: int = DEFAULT_NUM_EXAMPLES,
  num_epochs: int | None = None,
  shuffle: bool = True,
  num_packing_bins: int | None = None,
  drop_remainder: bool = True,
  num_threads: int = 0,
  form: str = "chat",
  examples: Sequence[dict] | None = None,
) -> grain.IterDataset:
  """IterDataset of packed SFT batches (dict format in the module docstring); form "chat" or "text".

  num_packing_bins (default 2 * batch_size): rows packed at once by first-fit; more bins = less padding.
  Packed rows are shuffled with `seed` before batching.
  """
  batch_size = _check_positive("batch_size", batch_size)
  seq_len = _check_positive("seq_len", seq_len)
  bins = _check_positive("num_packing_bins", num_packing_bins or 2 * batch_size)
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  ds = example_dataset(
    mixture=mixture,
    split=split,
    seed=seed,
    data_seed=data_seed,
    num_examples=num_examples,
    num_epochs=num_epochs,
    shuffle=shuffle,
    examples=examples,
  )
  docs = ds.map(lambda ex: document(tokenizer, ex, seq_len, form)).to_iter_dataset(_read_options(num_threads))
  return pack_and_batch(
    docs,
    batch_size=batch_size,
    seq_len=seq_len,
    num_packing_bins=bins,
    seed=seed,
    shuffle_bins=shuffle,
    drop_remainder=drop_remainder,
  )


def pack_and_batch(
  docs: grain.IterDataset,
  *,
  batch_size: int,
  seq_len: int,
  num_packing_bins: int,
  seed: int = 0,
  shuffle_bins: bool = True,
  drop_remainder: bool = True,
) -> grain.IterDataset:
  """First-fit packing (grain) of documents dict(inputs, targets, loss_mask) [T <= seq_len] into rows of
  seq_len, then batches of batch_size rows in the SFT batch format. Padding: 0 everywhere."""
  lengths = {"inputs": seq_len, "targets": seq_len, "loss_mask": seq_len}
  ds = grain.experimental.FirstFitPackIterDataset(
    docs, length_struct=lengths, num_packing_bins=num_packing_bins, seed=seed, shuffle_bins=shuffle_bins
  )
  return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=_collate_packed)


def padded_chunk(chunk: Sequence, rows: int) -> list:
  """A batch's `chunk` of items filled up to `rows` with copies of its last item (a fixed batch shape; the copies'
  outputs are dropped)."""
  return list(chunk) + [chunk[-1]] * (rows - len(chunk))


def pad_prompts(
  prompts: Sequence[Sequence[int]], max_prompt_len: int, *, pad_id: int = 0, pad_side: str = "left"
) -> dict:
  """tokens / lengths / segment_ids / positions of a list of prompt id lists (see module docstring)."""
  if pad_side not in ("left", "right"):
    raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
  n = len(prompts)
  tokens = np.full((n, max_prompt_len), pad_id, np.int32)
  segment_ids = np.zeros((n, max_prompt_len), np.int32)
  positions = np.zeros((n, max_prompt_len), np.int32)
  lengths = np.zeros((n,), np.int32)
  for b, ids in enumerate(prompts):
    t = len(ids)
    if t > max_prompt_len or t == 0:
      raise ValueError(f"prompt {b} has {t} tokens; max_prompt_len={max_prompt_len} (and prompts must be non-empty)")
    start = max_prompt_len - t if pad_side == "left" else 0
    tokens[b, start : start + t] = ids
    segment_ids[b, start : start + t] = 1
    positions[b, start : start + t] = np.arange(t)
    lengths[b] = t
  return {"tokens": tokens, "lengths": lengths, "segment_ids": segment_ids, "positions": positions}


def prompt_dataset(
  tokenizer: Tokenizer,
  *,
  batch_size: int,
  max_prompt_len: int = 32,
  mixture: str | Sequence[tasks.MixtureComponent] = "default",
  split: str = "train",
  seed: int = 0,
  data_seed: int | None = None,
  num_examples: int = DEFAULT_NUM_EXAMPLES,
  num_epochs: int | None = None,
  shuffle: bool = True,
  pad_side: str = "left",
  drop_remainder: bool = True,
  num_threads: int = 0,
  examples: Sequence[dict] | None = None,
) -> grain.IterDataset:
  """IterDataset of RL prompt batches (dict format in the module docstring). For a fixed held-out eval set use
  split="test", num_examples=N, num_epochs=1, shuffle=False, drop_remainder=False."""
  batch_size = _check_positive("batch_size", batch_size)
  max_prompt_len = _check_positive("max_prompt_len", max_prompt_len)
  if pad_side not in ("left", "right"):
    raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
  ds = example_dataset(
    mixture=mixture,
    split=split,
    seed=seed,
    data_seed=data_seed,
    num_examples=num_examples,
    num_epochs=num_epochs,
    shuffle=shuffle,
    examples=examples,
  )

  def collate(examples: Sequence[dict]) -> dict:
    batch = pad_prompts(
      [tokenizer.format_prompt(ex["prompt"]) for ex in examples],
      max_prompt_len,
      pad_id=tokenizer.pad_id,
      pad_side=pad_side,
    )
    batch["examples"] = list(examples)
    return batch

  ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=collate)
  return ds.to_iter_dataset(_read_options(num_threads))


def future_targets(
  targets: np.ndarray, loss_mask: np.ndarray, segment_ids: np.ndarray, k: int, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Targets k further ahead for MTP module k-1 (k >= 1): out[b, t] = targets[b, t + k] and the mask of it,
  both zeroed where t + k leaves the row or the document (segment_ids differ). Works on NumPy or JAX arrays
  [B, L]; k = 0 returns the inputs."""
  if targets.shape != loss_mask.shape or targets.shape != segment_ids.shape or targets.ndim != 2:
    raise ValueError(
      f"targets, loss_mask, segment_ids must share a [B, L] shape, got {targets.shape}, "
      f"{loss_mask.shape}, {segment_ids.shape}"
    )
  if k < 0:
    raise ValueError(f"k must be >= 0, got {k}")
  if k == 0:
    return targets, loss_mask
  if isinstance(targets, np.ndarray):
    xp = np
  else:
    import jax.numpy as xp  # pylint: disable=import-outside-toplevel
  b, length = targets.shape
  k_eff = min(k, length)

  def shift(x, fill):
    return xp.concatenate([x[:, k_eff:], xp.full((b, k_eff), fill, x.dtype)], axis=1)

  same = (shift(segment_ids, 0) == segment_ids) & (segment_ids > 0)
  out_t = xp.where(same, shift(targets, pad_id), pad_id).astype(targets.dtype)
  out_m = xp.where(same, shift(loss_mask, 0), 0).astype(loss_mask.dtype)
  return out_t, out_m
