"""train/evaluate.py's memo: an evaluation runs once per fingerprint (weights, eval settings, tokenizer, examples),
and any change to one of those runs it again."""

import ml_collections
import numpy as np
import pytest

from stepflash_jax.train import evaluate


class _Tok:
  def __init__(self, pieces):
    self.pieces, self.vocab_size = pieces, len(pieces)

  def id_to_piece(self, i):
    return self.pieces[i]


def _inputs():
  config = ml_collections.ConfigDict(
    dict(eval=dict(max_new_tokens=8, batch_size=4), model=dict(hidden=8), data=dict(max_prompt_len=6, seed=0))
  )
  variables = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "router": {"b": np.zeros(2, np.float32)}}
  return config, variables, _Tok(["<pad>", "1", "+"]), [{"prompt": "1+1", "answer": "2"}]


@pytest.fixture
def calls(monkeypatch):
  made = []
  monkeypatch.setattr(evaluate, "_memo", {})
  monkeypatch.setattr(evaluate, "_accuracy", lambda *a, **k: made.append(a) or {"accuracy": len(made) / 10})
  return made


def test_same_inputs_evaluate_once(calls):
  config, variables, tok, examples = _inputs()
  first = evaluate.accuracy(config, variables, tok, examples)
  first["accuracy"] = -1.0  # the caller's copy: the memo keeps its own
  again = evaluate.accuracy(config, {k: dict(v) for k, v in variables.items()}, tok, list(examples))
  assert len(calls) == 1 and again == {"accuracy": 0.1}


def _changed(what):
  config, variables, tok, examples = _inputs()
  if what == "weight value":
    variables["params"]["w"] = variables["params"]["w"].copy()
    variables["params"]["w"][1, 2] += 1e-6
  elif what == "weight dtype":
    variables["router"]["b"] = np.zeros(2, np.int32)  # the same bytes
  elif what == "eval field":
    config.eval.max_new_tokens = 9
  elif what == "prompt width":
    config.data.max_prompt_len = 7
  elif what == "agent section":
    config.agent = dict(max_turns=2)
  elif what == "tokenizer":
    tok = _Tok(["<pad>", "1", "-"])
  elif what == "example":
    examples = [{"prompt": "1+1", "answer": "3"}]
  return config, variables, tok, examples


@pytest.mark.parametrize(
  "what", ["weight value", "weight dtype", "eval field", "prompt width", "agent section", "tokenizer", "example"]
)
def test_any_change_evaluates_again(calls, what):
  base = _inputs()
  assert evaluate.fingerprint(*base) == evaluate.fingerprint(*_inputs())
  assert evaluate.fingerprint(*_changed(what)) != evaluate.fingerprint(*base)
  evaluate.accuracy(*base)
  assert evaluate.accuracy(*_changed(what)) == {"accuracy": 0.2} and len(calls) == 2


def test_large_weights_are_not_memoized(calls, monkeypatch):
  monkeypatch.setattr(evaluate, "MEMO_MAX_BYTES", 8)  # below the 24 + 8 bytes of _inputs()'s weights
  assert evaluate.fingerprint(*_inputs()) is None
  evaluate.accuracy(*_inputs())
  evaluate.accuracy(*_inputs())
  assert len(calls) == 2 and evaluate._memo == {}
