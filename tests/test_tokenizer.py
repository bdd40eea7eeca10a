"""SentencePiece tokenizer: special ids, exact round trip on every family, chat template, caching."""

import os

import numpy as np
import pytest

from stepflash_jax.data import tasks
from stepflash_jax.data.tokenizer import Tokenizer, load_tokenizer, model_filename, train_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return load_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_special_ids_and_vocab(tok):
  assert tok.vocab_size == 512
  assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
  assert (tok.user_id, tok.assistant_id, tok.think_id, tok.end_think_id) == (4, 5, 6, 7)
  for piece in ("<|user|>", "<|assistant|>", "<think>", "</think>"):
    assert tok.encode(piece) == [tok.special_ids[piece]]
    assert tok.id_to_piece(tok.special_ids[piece]) == piece
  # pad / bos / eos and the reserved filler pieces decode to nothing
  assert tok.decode([tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size - 1]) == ""
  assert tok.id_to_piece(tok.vocab_size - 1).startswith("<|reserved_")


def test_digits_and_math_symbols_are_single_pieces(tok):
  ids = tok.encode("1234567890+-*=,()")
  assert [tok.id_to_piece(i) for i in ids] == list("1234567890+-*=,()")
  assert len(set(ids)) == 17


@pytest.mark.parametrize("family", ["arithmetic", "countdown", "countdown_search"])  # its "<>;": byte pieces
def test_round_trip_every_family(tok, family):
  task = tasks.get_task(family)
  for d in task.DIFFICULTIES:
    for v in task.VARIANTS:
      for split in ("train", "test"):
        for s in range(3):
          ex = task.generate(s, d, split, v)
          for text in (ex["prompt"], ex["answer"], tok.format_prompt_text(ex["prompt"]) + ex["answer"]):
            ids = tok.encode(text)
            assert tok.unk_id not in ids
            assert tok.decode(ids) == text


def test_round_trip_unusual_text(tok):
  for text in ("  two  spaces ", "line\nbreak\t tab", "ünïcödé 中文 ✓", "", "<think></think>"):
    assert tok.decode(tok.encode(text)) == text


def test_chat_template(tok):
  prompt, answer = "Compute 12+34", "<think>2+4+0=06,1+3+0=04</think>46"
  p = tok.format_prompt(prompt)
  assert p[:2] == [tok.bos_id, tok.user_id] and p[-1] == tok.assistant_id
  assert p[2:-1] == tok.encode(prompt)
  ids, mask = tok.format_example(prompt, answer)
  assert ids.dtype == np.int32 and mask.dtype == np.float32 and ids.shape == mask.shape
  np.testing.assert_array_equal(ids, p + tok.encode(answer) + [tok.eos_id])
  n_ans = len(tok.encode(answer)) + 1
  np.testing.assert_array_equal(mask, [0.0] * len(p) + [1.0] * n_ans)
  assert ids[len(p)] == tok.think_id
  assert tok.decode(ids) == "<|user|>" + prompt + "<|assistant|>" + answer
  # 2+2 digit addition: 2 + 1 + 1 + 5 prompt pieces + <|assistant|>, answer 1 + 2*9-1 + 1 + 2 + eos
  assert len(ids) == (2 + 1 + 1 + 5 + 1) + (1 + 17 + 1 + 2 + 1)


def test_decode_options_and_errors(tok):
  ids = tok.encode("12") + [tok.eos_id] + tok.encode("34")
  assert tok.decode(ids) == "1234"
  assert tok.decode(np.asarray(ids), stop_at_eos=True) == "12"
  with pytest.raises(ValueError, match="ids"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="ids"):
    tok.decode(np.zeros((2, 2), np.int32))
  with pytest.raises(ValueError, match="text"):
    tok.encode(None)
  with pytest.raises(ValueError, match="model_path"):
    Tokenizer("/nonexistent/sp.model")
  with pytest.raises(ValueError, match="vocab_size"):
    train_tokenizer("/tmp/unused.model", vocab_size=100)


def test_training_is_reproducible_and_cached(tmp_path, tok):
  a = train_tokenizer(str(tmp_path / "a.model"))
  with open(a, "rb") as f, open(tok.model_path, "rb") as g:
    assert f.read() == g.read()
  cache = tmp_path / "cache"
  t1 = load_tokenizer(str(cache))
  path = os.path.join(str(cache), model_filename())
  assert t1.model_path == path and os.path.exists(path)
  mtime = os.stat(path).st_mtime_ns
  t2 = load_tokenizer(str(cache))  # loads the existing file, does not retrain
  assert os.stat(path).st_mtime_ns == mtime and t2.encode("Make 5") == t1.encode("Make 5")
  assert load_tokenizer(str(cache), vocab_size=640).vocab_size == 640
  # the cache key follows the corpus: a changed generator cannot load a stale model
  assert model_filename(512, ["a b"]) != model_filename(512, ["a c"]) != model_filename(640, ["a c"])
