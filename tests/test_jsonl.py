"""User prompt data: the answer verifiers (data/verifiers.py) and JSONL prompt files (data/jsonl.py)."""

import json
import operator
import sys
import textwrap

import pytest

from stepflash_jax.data import jsonl, load_tokenizer, tasks, verifiers
from stepflash_jax.data.tasks import base


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer()


def _write(path, lines):
  path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
  return str(path)


def _module(tmp_path, monkeypatch, name, source):
  """A module `name` written to tmp_path (on sys.path), removed from sys.modules afterwards."""
  (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, name, raising=False)
  return name


@pytest.mark.parametrize(
  "completion, expected",
  [
    ("<think>6*7=42</think> 42 \n", "42"),
    ("<think>r</think>line one\nline two\n", "line one\nline two"),  # multi-line answers are kept
    ("<think>6*7=", None),  # cut off inside the reasoning
    ("<think>a</think>b<think>c", None),  # re-opened and cut off
    ("<think>r</think>  \n", None),  # empty answer
    ("  plain answer ", "plain answer"),
    ("junk</think>y", "y"),
  ],
)
def test_final_answer(completion, expected):
  assert verifiers.final_answer(completion) == expected


def test_final_answer_keeps_lines_that_extract_answer_drops():
  completion = "<think>r</think>x = 1\ny = 2"
  assert base.extract_answer(completion) == "x = 1"
  assert verifiers.final_answer(completion) == "x = 1\ny = 2"


@pytest.mark.parametrize(
  "name, completion, reference, expected",
  [
    ("exact", "<think>r</think>Paris", " Paris\n", True),
    ("exact", "<think>r</think>paris", "Paris", False),
    ("exact", "<think>Paris", "Paris", False),
    ("numeric", "<think>r</think>The total is 1,234.", "1234", True),
    ("numeric", "<think>r</think>1,234,567", "1234567", True),
    ("numeric", "<think>r</think>it is -3.5", "-3.5", True),
    ("numeric", "<think>r</think>x = -2.5e3", "-2500", True),
    ("numeric", "6.02E23 atoms", "6.02e23", True),
    ("numeric", "0.1 + 0.2 = 0.30000000000000004", "0.3", True),  # rel 1e-6
    ("numeric", "1e-10", "0", True),  # abs 1e-9
    ("numeric", "1.001", "1", False),
    ("numeric", "3-5", "5", True),  # a minus between numbers is an operator, not a sign
    ("numeric", "3-5", "-5", False),
    ("numeric", "first 12, then 13", "12", False),  # the last number counts
    ("numeric", "12,34", "34", True),  # not a thousands group: two numbers
    ("numeric", "<think>r</think>no number", "0", False),
    ("numeric", "<think>it is 42", "42", False),
    ("contains", "<think>r</think>The capital is Paris.", "Paris", True),
    ("contains", "<think>Paris?</think>London", "Paris", False),  # only the final answer is searched
    ("boxed", "<think>r</think>so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", True),
    ("boxed", "\\boxed{1} no, \\boxed {x^{2}} ", "x^{2}", True),
    ("boxed", "\\boxed{1} then \\boxed{2", "1", False),  # the last box is never closed
    ("boxed", "<think>\\boxed{3}", "3", False),  # cut-off reasoning
    ("boxed", "<think>r</think>3", "3", False),
  ],
)
def test_builtin_verifiers(name, completion, reference, expected):
  assert verifiers.verify(name, completion, reference) is expected
  assert bool(verifiers.get_verifier(name)(completion, reference)) is expected


def test_registry_and_raising_verifier(monkeypatch):
  monkeypatch.setattr(verifiers, "_VERIFIERS", dict(verifiers._VERIFIERS))
  monkeypatch.setattr(verifiers, "_WARNED", set())
  assert verifiers.available_verifiers() == ["boxed", "contains", "exact", "numeric"]

  def crashes(completion, reference):
    raise ZeroDivisionError("hostile")

  verifiers.register_verifier("crashes", crashes)
  verifiers.register_verifier("length", lambda c, r: len(c) - int(r))  # truthy ints become bools
  assert verifiers.available_verifiers() == ["boxed", "contains", "crashes", "exact", "length", "numeric"]
  with pytest.warns(UserWarning, match="crashes"):
    assert verifiers.verify("crashes", "anything", "1") is False
  assert verifiers.verify("length", "abc", "3") is False and verifiers.verify("length", "abcd", "3") is True
  with pytest.warns(UserWarning, match="exact"):
    assert verifiers.verify("exact", None, "1") is False  # a non-str completion is wrong, not a crash
  with pytest.raises(ValueError, match="already registered"):
    verifiers.register_verifier("exact", crashes)
  verifiers.register_verifier("exact", crashes, overwrite=True)
  assert verifiers.get_verifier("exact") is crashes
  for name, fn in [("a:b", crashes), ("", crashes), ("ok", 3)]:
    with pytest.raises(ValueError):
      verifiers.register_verifier(name, fn)
  with pytest.raises(ValueError, match=r"unknown verifier 'foo' \(registered: boxed, contains, crashes, exact"):
    verifiers.get_verifier("foo")


def test_entry_points(tmp_path, monkeypatch):
  name = _module(
    tmp_path,
    monkeypatch,
    "sfj_verifiers_ok",
    """
    NOT_CALLABLE = 3
    def first_word(completion, reference):
      return completion.split()[0] == reference
    class Grader:
      @staticmethod
      def upper(completion, reference):
        return completion.upper() == reference
    """,
  )
  monkeypatch.setattr(verifiers, "_WARNED", set())
  spec = f"{name}:first_word"
  fn = verifiers.get_verifier(spec)
  assert fn is sys.modules[name].first_word
  assert verifiers.verify(spec, "yes it is", "yes") and not verifiers.verify(spec, "no it is", "yes")
  with pytest.warns(UserWarning, match="IndexError"):
    assert not verifiers.verify(spec, "", "yes")  # IndexError inside the verifier counts as wrong
  assert verifiers.verify(f"{name}:Grader.upper", "ab", "AB")
  assert verifiers.get_verifier("operator:eq") is operator.eq
  del sys.modules[name]  # resolved entry points are cached: no second import
  assert verifiers.get_verifier(spec) is fn and name not in sys.modules


def test_bad_entry_points(tmp_path, monkeypatch):
  ok = _module(tmp_path, monkeypatch, "sfj_verifiers_bad", "NOT_CALLABLE = 3\n")
  broken = _module(tmp_path, monkeypatch, "sfj_verifiers_broken", "raise RuntimeError('boom at import')\n")
  cases = {
    "sfj_no_such_module_xyz:fn": "cannot import module",
    f"{ok}:missing": "no attribute 'missing'",
    f"{ok}:NOT_CALLABLE": "not callable",
    f"{broken}:fn": "boom at import",
    ":fn": "package.module:function",
    f"{ok}:": "package.module:function",
  }
  for spec, message in cases.items():
    with pytest.raises(ValueError, match=message) as info:
      verifiers.get_verifier(spec)
    assert repr(spec) in str(info.value)


def test_read_jsonl_reports_bad_lines(tmp_path, tok):
  limit = 24
  long_prompt = "Add " + " + ".join(str(i) for i in range(40))
  lines = [
    {"prompt": "What is 2+3?", "reference": "5"},  # 1
    "",  # 2 blank
    '{"prompt": "x", "reference": "1"',  # 3 malformed JSON
    {"reference": "1"},  # 4 prompt missing
    {"prompt": 7, "reference": "1"},  # 5 prompt not a string
    {"prompt": "What is 1+1?"},  # 6 reference missing
    {"prompt": "What is 1+1?", "reference": True},  # 7 reference of the wrong type
    {"prompt": "What is 1+1?", "reference": "2", "verifier": "foo"},  # 8 unknown verifier
    {"prompt": "What is 6*7?", "reference": 42, "verifier": "numeric", "response": "<think>6*7=42</think>42"},  # 9
    {"prompt": long_prompt, "reference": "780"},  # 10 too long
    {"prompt": "What is 1+1?", "reference": "2", "split": "valid"},  # 11 bad split
    '["prompt", "reference"]',  # 12 not an object
    {"prompt": "Name a fruit", "reference": "apple", "verifier": "contains", "split": "test"},  # 13
    {"prompt": "What is 1+1?", "reference": "two", "verifier": "numeric"},  # 14 not a number
    {"prompt": "Half of 5?", "reference": 2.5, "verifier": "numeric", "source": "extra keys are ignored"},  # 15
    {"prompt": "What is 1+1?", "reference": "2", "verifier": "sfj_no_such_module_xyz:fn"},  # 16
  ]
  path = _write(tmp_path / "data.jsonl", lines)
  examples, errors = jsonl.read_jsonl(path, tok, max_prompt_len=limit)
  expected = {
    3: "not valid JSON",
    4: "field 'prompt' is required",
    5: "field 'prompt' must be a non-empty string",
    6: "field 'reference' is required",
    7: "field 'reference' must be",
    8: "field 'verifier': unknown verifier 'foo' (registered: boxed, contains, exact, numeric",
    10: f"prompt has {len(tok.format_prompt(long_prompt))} tokens > data.max_prompt_len={limit}",
    11: "field 'split'",
    12: "JSON object",
    14: "field 'reference': 'two' is not a number",
    16: "field 'verifier': verifier entry point 'sfj_no_such_module_xyz:fn'",
  }
  assert [int(e.split(":")[1]) for e in errors] == sorted(expected)
  for err, (line, message) in zip(errors, sorted(expected.items())):
    assert err.startswith(f"{path}:{line}: ") and message in err, err
  assert [ex["metadata"]["line"] for ex in examples] == [1, 9, 13, 15]
  assert [ex["prompt"] for ex in examples] == [lines[i - 1]["prompt"] for i in (1, 9, 13, 15)]
  assert all(len(tok.format_prompt(ex["prompt"])) <= limit for ex in examples)
  nine = examples[1]
  assert nine == {
    "prompt": "What is 6*7?",
    "answer": "<think>6*7=42</think>42",
    "family": "jsonl",
    "difficulty": 0,
    "metadata": {
      "problem": "What is 6*7?",
      "reference": "42",
      "verifier": "numeric",
      "split": base.split_of("What is 6*7?"),
      "line": 9,
      "path": path,
    },
  }
  assert examples[0]["answer"] == "5" and examples[3]["metadata"]["reference"] == "2.5"
  # without a tokenizer there is no length limit: the long prompt is kept
  assert [ex["metadata"]["line"] for ex in jsonl.read_jsonl(path)[0]] == [1, 9, 10, 13, 15]


def test_read_jsonl_sft_limits(tmp_path, tok):
  short = ("What is 2+3?", "<think>2+3=5</think>5")
  long = ("What is 2+3?", "<think>" + ",".join(["2+3=5"] * 30) + "</think>5")
  n_short, n_long = (len(tok.format_example(*pair)[0]) - 1 for pair in (short, long))
  seq_len = (n_short + n_long) // 2
  lines = [
    {"prompt": short[0], "reference": "5", "response": short[1]},
    {"prompt": "What is 1+1?", "reference": "2"},
    {"prompt": long[0], "reference": "5", "response": long[1]},
    {"prompt": "What is 1+2?", "reference": "3", "response": ""},
  ]
  path = _write(tmp_path / "sft.jsonl", lines)
  examples, errors = jsonl.read_jsonl(path, tok, max_prompt_len=64, seq_len=seq_len, require_response=True)
  assert [ex["metadata"]["line"] for ex in examples] == [1]
  assert examples[0]["answer"] == short[1]
  assert errors[0] == f"{path}:2: field 'response' is required for SFT"
  assert (
    errors[1].startswith(f"{path}:3: ") and f"{n_long} tokens" in errors[1] and f"data.seq_len={seq_len}" in errors[1]
  )
  assert errors[2].startswith(f"{path}:4: field 'response' must be a non-empty string")
  # RL reads the same file: responses are optional, an empty one is still malformed
  examples, errors = jsonl.read_jsonl(path, tok, max_prompt_len=64, seq_len=seq_len)
  assert [ex["metadata"]["line"] for ex in examples] == [1, 2, 3] and len(errors) == 1


def test_split_assignment(tmp_path):
  prompts = [f"Question number {i}: what is {i} + {i}?" for i in range(300)]
  lines = [{"prompt": p, "reference": str(2 * i)} for i, p in enumerate(prompts)]
  lines[0]["split"], lines[1]["split"] = "test", "train"
  examples, errors = jsonl.read_jsonl(_write(tmp_path / "s.jsonl", lines))
  assert not errors
  splits = [ex["metadata"]["split"] for ex in examples]
  assert splits[:2] == ["test", "train"]
  assert splits[2:] == [base.split_of(p) for p in prompts[2:]]
  assert all(base.split_of(jsonl.canonical(ex["metadata"])) == s for ex, s in zip(examples[2:], splits[2:]))
  assert 10 <= splits.count("test") <= 60  # ~10% of 300


def test_tasks_check_dispatches_to_jsonl(tmp_path, monkeypatch):
  name = _module(tmp_path, monkeypatch, "sfj_verifiers_len", "def same_len(c, r):\n  return len(c) == int(r)\n")
  lines = [
    {"prompt": "What is 6*7?", "reference": 42, "verifier": "numeric"},
    {"prompt": "Box 9", "reference": "9", "verifier": "boxed"},
    {"prompt": "Three letters", "reference": "3", "verifier": f"{name}:same_len"},
  ]
  numeric, boxed, custom = jsonl.read_jsonl(_write(tmp_path / "c.jsonl", lines))[0]
  assert tasks.get_task("jsonl") is jsonl and "jsonl" in tasks.families()
  assert tasks.check(numeric, "<think>6*7=42</think>The answer is 42.") is True
  assert tasks.check(numeric, "<think>6*7=42</think>43") is False
  assert tasks.check(numeric, "<think>6*7=42") is False
  assert jsonl.check(numeric["metadata"], "42.0") is True  # metadata alone works too
  assert tasks.check(boxed, "\\boxed{9}") is True and tasks.check(boxed, "\\boxed{8}") is False
  assert tasks.check(custom, "abc") is True and tasks.check(custom, "abcd") is False
  with pytest.raises(ValueError, match="data.jsonl"):
    tasks.generate("jsonl", 0, 0)


def test_load_examples_caches_and_logs(tmp_path):
  lines = [
    {"prompt": "a", "reference": "1", "split": "train"},
    "not json",
    {"prompt": "b", "reference": "2", "split": "test"},
    {"prompt": "c", "reference": "3", "split": "train"},
  ]
  path = _write(tmp_path / "data.jsonl", lines)
  log = []
  train = jsonl.load_examples(path, None, "train", max_prompt_len=None, log=log.append)
  assert [ex["prompt"] for ex in train] == ["a", "c"]
  assert log[0] == f"{path}: 3 valid records (train 2, test 1), 1 skipped"
  assert len(log) == 2 and log[1].startswith(f"{path}:2: not valid JSON")
  log.clear()
  test = jsonl.load_examples(path, None, "test", max_prompt_len=None, log=log.append)
  assert [ex["prompt"] for ex in test] == ["b"] and log == []  # cached: read and logged once
  _write(tmp_path / "data.jsonl", lines + [{"prompt": "d", "reference": "4", "split": "test"}])
  test = jsonl.load_examples(path, None, "test", max_prompt_len=None, log=log.append)
  assert [ex["prompt"] for ex in test] == ["b", "d"]  # a changed file is read again
  assert log[0] == f"{path}: 4 valid records (train 2, test 2), 1 skipped"


def test_load_examples_caps_logged_errors(tmp_path):
  lines = [{"prompt": f"q{i}", "reference": str(i), "split": "train"} for i in range(2)] + ["{"] * 25
  path = _write(tmp_path / "many.jsonl", lines)
  log = []
  jsonl.load_examples(path, None, "train", max_prompt_len=None, log=log.append)
  assert log[0] == f"{path}: 2 valid records (train 2, test 0), 25 skipped"
  assert [int(x.split(":")[1]) for x in log[1:-1]] == list(range(3, 23))
  assert log[-1] == "... and 5 more"


def test_load_examples_errors(tmp_path):
  only_train = _write(tmp_path / "train_only.jsonl", [{"prompt": "a", "reference": "1", "split": "train"}])
  with pytest.raises(ValueError, match="no 'test' records") as info:
    jsonl.load_examples(only_train, None, "test", max_prompt_len=None, log=lambda _: None)
  assert only_train in str(info.value)
  missing = str(tmp_path / "missing.jsonl")
  for load in (
    lambda: jsonl.read_jsonl(missing),
    lambda: jsonl.load_examples(missing, None, "train", max_prompt_len=8),
  ):
    with pytest.raises(ValueError, match="no such file") as info:
      load()
    assert missing in str(info.value)
  all_bad = _write(tmp_path / "bad.jsonl", ["{", {"prompt": ""}, "", {"prompt": "x", "reference": None}])
  with pytest.raises(ValueError) as info:
    jsonl.load_examples(all_bad, None, "train", max_prompt_len=None, log=lambda _: None)
  message = str(info.value)
  assert f"{all_bad}: no valid record (3 skipped)" in message
  assert f"{all_bad}:1: not valid JSON" in message and f"{all_bad}:2: field 'prompt'" in message
  assert f"{all_bad}:4: field 'reference'" in message
  with pytest.raises(ValueError, match="no valid record"):
    jsonl.read_jsonl(_write(tmp_path / "empty.jsonl", ["", "  "]))
