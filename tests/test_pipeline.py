"""grain pipelines: packing layout, document isolation, prompt batches, shuffling, iterator state restore."""

import json

import grain
import numpy as np
import pytest

from stepflash_jax.data import pipeline, tasks
from stepflash_jax.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return load_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _doc(ids, mask):
  ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.float32)
  return {"inputs": ids[:-1], "targets": ids[1:], "loss_mask": mask[1:]}


def test_packing_hand_checked():
  # documents of 4, 3, 5 tokens (3, 2, 4 after the shift), rows of 5, 2 bins, first fit, no shuffling
  docs = [
    _doc([11, 12, 13, 14], [0, 0, 1, 1]),
    _doc([21, 22, 23], [0, 1, 1]),
    _doc([31, 32, 33, 34, 35], [0, 0, 0, 1, 1]),
  ]
  ds = grain.MapDataset.source(docs).to_iter_dataset()
  batch = next(iter(pipeline.pack_and_batch(ds, batch_size=2, seq_len=5, num_packing_bins=2, shuffle_bins=False)))
  np.testing.assert_array_equal(batch["tokens"], [[11, 12, 13, 21, 22], [31, 32, 33, 34, 0]])
  np.testing.assert_array_equal(batch["targets"], [[12, 13, 14, 22, 23], [32, 33, 34, 35, 0]])
  np.testing.assert_array_equal(batch["loss_mask"], [[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
  assert {k: v.dtype for k, v in batch.items()} == {
    "tokens": np.int32,
    "targets": np.int32,
    "loss_mask": np.float32,
    "segment_ids": np.int32,
    "positions": np.int32,
  }


def _segments(batch):
  """Yields (row, segment id, slice) of every packed document."""
  for r, seg in enumerate(batch["segment_ids"]):
    for s in range(1, seg.max() + 1):
      idx = np.flatnonzero(seg == s)
      assert idx.size and np.all(np.diff(idx) == 1), "a document must be contiguous"
      yield r, s, slice(idx[0], idx[-1] + 1)


def test_sft_batches_are_the_examples_and_never_cross_documents(tok):
  kw = dict(batch_size=4, seq_len=96, seed=3, num_examples=64, num_epochs=1)
  batches = list(pipeline.sft_dataset(tok, drop_remainder=False, **kw))
  # reference: the formatted examples of the same (shuffled) stream
  exs = list(pipeline.example_dataset(seed=3, num_examples=64, num_epochs=1))
  ref = sorted(tuple(tok.format_example(e["prompt"], e["answer"])[0]) for e in exs)
  got = []
  for b in batches:
    assert b["tokens"].shape[1] == 96
    pad = b["segment_ids"] == 0
    assert np.all(b["tokens"][pad] == 0) and np.all(b["targets"][pad] == 0) and np.all(b["loss_mask"][pad] == 0)
    assert np.all(b["positions"][pad] == 0)
    for r, s, sl in _segments(b):
      toks, tgts, mask = b["tokens"][r, sl], b["targets"][r, sl], b["loss_mask"][r, sl]
      np.testing.assert_array_equal(b["positions"][r, sl], np.arange(len(toks)))
      np.testing.assert_array_equal(tgts[:-1], toks[1:])  # next token inside the document
      assert tgts[-1] == tok.eos_id and toks[0] == tok.bos_id  # the last target is the document's own eos
      # loss only on the assistant part: targets after the <|assistant|> marker
      start = int(np.flatnonzero(toks == tok.assistant_id)[0])
      np.testing.assert_array_equal(mask, (np.arange(len(toks)) >= start).astype(np.float32))
      got.append(tuple(np.concatenate([toks, tgts[-1:]])))
  assert sorted(got) == ref  # every example exactly once, nothing cut


def test_text_form_is_the_plain_example_with_loss_everywhere(tok):
  kw = dict(batch_size=4, seq_len=96, seed=3, num_examples=32, num_epochs=1, drop_remainder=False)
  exs = list(pipeline.example_dataset(seed=3, num_examples=32, num_epochs=1))
  ref = sorted(
    tuple([tok.bos_id] + tok.encode(e["prompt"] + "\n" + e["answer"]) + [tok.eos_id]) for e in exs
  )  # independent of the chat template: no <|user|> / <|assistant|> markers
  got = []
  for b in pipeline.sft_dataset(tok, form="text", **kw):
    np.testing.assert_array_equal(b["loss_mask"], (b["segment_ids"] > 0).astype(np.float32))
    for r, s, sl in _segments(b):
      toks = b["tokens"][r, sl]
      assert tok.assistant_id not in toks and tok.user_id not in toks
      got.append(tuple(np.concatenate([toks, b["targets"][r, sl][-1:]])))
  assert sorted(got) == ref


def test_sft_fill_and_shuffle_by_seed(tok):
  def first(seed):
    return next(iter(pipeline.sft_dataset(tok, batch_size=8, seq_len=128, seed=seed)))

  a, b, c = first(0), first(0), first(1)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["tokens"], c["tokens"])
  assert (a["segment_ids"] > 0).mean() > 0.75  # first-fit keeps padding low
  # same problems (data_seed), different order (seed)
  e1 = list(pipeline.example_dataset(seed=0, data_seed=5, num_examples=32, num_epochs=1))
  e2 = list(pipeline.example_dataset(seed=1, data_seed=5, num_examples=32, num_epochs=1))
  assert e1 != e2 and sorted(map(repr, e1)) == sorted(map(repr, e2))


def _assert_same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    if k == "examples":
      assert a[k] == b[k]
    else:
      np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("kind", ["sft", "prompt"])
def test_iterator_state_restore(tok, kind):
  def make():
    if kind == "sft":
      return pipeline.sft_dataset(tok, batch_size=4, seq_len=64, seed=2, num_packing_bins=6)
    return pipeline.prompt_dataset(tok, batch_size=4, seed=2)

  it = iter(make())
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # states are plain JSON
  expected = [next(it) for _ in range(4)]
  it2 = iter(make())
  it2.set_state(state)
  for e in expected:
    _assert_same(e, next(it2))


@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_prompt_batches(tok, pad_side):
  it = iter(pipeline.prompt_dataset(tok, batch_size=5, max_prompt_len=24, seed=1, pad_side=pad_side, split="test"))
  b = next(it)
  assert b["tokens"].shape == (5, 24) and b["lengths"].shape == (5,) and len(b["examples"]) == 5
  for i, ex in enumerate(b["examples"]):
    ids = tok.format_prompt(ex["prompt"])
    n = len(ids)
    assert b["lengths"][i] == n
    real = slice(24 - n, 24) if pad_side == "left" else slice(0, n)
    np.testing.assert_array_equal(b["tokens"][i, real], ids)
    np.testing.assert_array_equal(b["positions"][i, real], np.arange(n))
    assert b["segment_ids"][i].sum() == n and np.all(b["segment_ids"][i, real] == 1)
    assert np.all(b["tokens"][i][b["segment_ids"][i] == 0] == tok.pad_id)
    task = tasks.get_task(ex["family"])
    assert tasks.split_of(task.canonical(ex["metadata"])) == "test"
    assert tasks.check(ex, ex["answer"])


def test_eval_stream_is_finite_and_fixed(tok):
  kw = dict(batch_size=8, split="test", num_examples=20, num_epochs=1, shuffle=False, drop_remainder=False)
  b1 = list(pipeline.prompt_dataset(tok, **kw))
  b2 = list(pipeline.prompt_dataset(tok, **kw))
  assert [len(b["examples"]) for b in b1] == [8, 8, 4]
  assert [b["examples"] for b in b1] == [b["examples"] for b in b2]


def test_bad_arguments(tok):
  with pytest.raises(ValueError, match="seq_len"):
    next(iter(pipeline.sft_dataset(tok, batch_size=2, seq_len=20)))
  with pytest.raises(ValueError, match="batch_size"):
    pipeline.sft_dataset(tok, batch_size=0, seq_len=64)
  with pytest.raises(ValueError, match="form must be one of"):
    pipeline.sft_dataset(tok, batch_size=2, seq_len=64, form="markdown")
  with pytest.raises(ValueError, match="pad_side"):
    pipeline.prompt_dataset(tok, batch_size=2, pad_side="middle")
  with pytest.raises(ValueError, match="max_prompt_len"):
    next(iter(pipeline.prompt_dataset(tok, batch_size=2, max_prompt_len=4)))
  with pytest.raises(ValueError, match="split"):
    pipeline.example_dataset(split="valid")


def test_future_targets_match_loop():
  rng = np.random.default_rng(0)
  seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 3]], np.int32)
  tgt = rng.integers(1, 50, seg.shape).astype(np.int32) * (seg > 0)
  mask = rng.integers(0, 2, seg.shape).astype(np.float32) * (seg > 0)
  for k in range(0, 10):
    out_t, out_m = pipeline.future_targets(tgt, mask, seg, k)
    for b in range(2):
      for t in range(8):
        ok = t + k < 8 and seg[b, t] > 0 and seg[b, t + k] == seg[b, t]
        assert out_t[b, t] == (tgt[b, t + k] if ok else 0)
        assert out_m[b, t] == (mask[b, t + k] if ok else 0)
  import jax.numpy as jnp

  jt, jm = pipeline.future_targets(jnp.asarray(tgt), jnp.asarray(mask), jnp.asarray(seg), 2)
  nt, nm = pipeline.future_targets(tgt, mask, seg, 2)
  np.testing.assert_array_equal(np.asarray(jt), nt)
  np.testing.assert_array_equal(np.asarray(jm), nm)
