"""Task families: determinism, reference answers, checkers on right/wrong answers, disjoint splits."""

import collections
import re

import pytest

from stepflash_jax.data import tasks
from stepflash_jax.data.tasks import arithmetic, base, countdown, countdown_search, longmul

SETTINGS = [
  (f, d, v)
  for f in ("arithmetic", "countdown", "longmul")
  for d in tasks.get_task(f).DIFFICULTIES
  for v in tasks.get_task(f).VARIANTS
]


@pytest.mark.parametrize("family", ["arithmetic", "countdown", "longmul"])
def test_deterministic_by_seed(family):
  task = tasks.get_task(family)
  for d in task.DIFFICULTIES:
    for split in ("train", "test"):
      a = [task.generate(s, d, split) for s in range(5)]
      b = [task.generate(s, d, split) for s in range(5)]
      assert a == b
      assert len({ex["prompt"] for ex in a}) > 1 or d == 1  # different seeds give different problems


def test_example_fields_and_reference_answers_pass():
  for family, d, v in SETTINGS:
    for s in range(8):
      ex = tasks.generate(family, s, d, "train", v)
      assert set(ex) == {"prompt", "answer", "family", "difficulty", "metadata"}
      assert ex["family"] == family and ex["difficulty"] == d
      assert re.fullmatch(r"<think>[^<>]+</think>[^<>]+", ex["answer"]), ex["answer"]
      assert tasks.check(ex, ex["answer"])
      assert tasks.get_task(family).check(ex["metadata"], ex["answer"])  # metadata alone works too


def test_arithmetic_known_traces():
  ex = arithmetic.make_example(347, 285, "+", 3)
  assert ex["prompt"] == "Compute 347+285"
  assert ex["answer"] == "<think>7+5+0=12,4+8+1=13,3+2+1=06</think>632"
  assert arithmetic.make_example(512, 298, "-", 3)["answer"] == "<think>2-8-0=14,1-9-1=11,5-2-1=02</think>214"
  assert arithmetic.make_example(347, 6, "*", 3)["answer"] == "<think>7*6+0=42,4*6+4=28,3*6+2=20</think>2082"
  assert arithmetic.make_example(9, 9, "+", 1)["answer"] == "<think>9+9+0=18</think>18"


def test_arithmetic_traces_match_a_digit_reference():
  """Every column 'x OP y OP c=kd': x, y the operand digits, d the result digit, k the next column's c."""
  for d in (2, 4, 7, 12):
    for op in "+-*":
      for s in range(10):
        ex = arithmetic.generate(s, d, variant=op) if d < 6 or op == "+" else None
        if ex is None:
          continue
        a, b = ex["metadata"]["a"], ex["metadata"]["b"]
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        body = ex["answer"][len("<think>") : ex["answer"].index("</think>")]
        carry = 0
        for i, col in enumerate(body.split(",")):
          x, y, c, k, digit = re.fullmatch(r"(\d)[-+*](\d)[-+](\d)=(\d)(\d)", col).groups()
          assert int(x) == (a // 10**i) % 10
          assert int(y) == (b if op == "*" else (b // 10**i) % 10)
          assert int(c) == carry and int(digit) == (result // 10**i) % 10
          carry = int(k)
        assert i == len(str(a)) - 1
        assert ex["answer"].endswith("</think>" + str(result))
        assert ex["metadata"]["a"] >= 10 ** (d - 1) and len(str(a)) == d


def test_longmul_trace_against_schoolbook_arithmetic():
  """Every partial product and running sum the trace states ("=N" entries) equals a * digit_j and the sum of the
  shifted partials so far; each column "x*y+c=kd" / "x+y+c=kd" is right; the final answer is a * b."""
  assert longmul.make_example(12, 34, 2)["answer"] == (
    "<think>2*4+0=08,1*4+0=04,=48,2*3+0=06,1*3+0=03,=36,0+8+0=08,6+4+0=10,3+0+1=04,=408</think>408"
  )
  for s in range(40):
    d = 2 + s % 4
    ex = tasks.generate("longmul", s, d, "train")
    a, b = ex["metadata"]["a"], ex["metadata"]["b"]
    assert len(str(a)) == len(str(b)) == d
    body = ex["answer"][len("<think>") : ex["answer"].index("</think>")]
    stated = [int(x[1:]) for x in body.split(",") if x.startswith("=")]
    digits = [int(c) for c in reversed(str(b))]
    partials = [a * y for y in digits]
    sums = [sum(p * 10**j for j, p in enumerate(partials[: k + 1])) for k in range(1, len(partials))]
    assert stated == partials + sums and sums[-1] == a * b
    for col in (x for x in body.split(",") if not x.startswith("=")):
      x, op, y, c, k, dgt = re.fullmatch(r"(\d)([*+])(\d)\+(\d)=(\d)(\d)", col).groups()
      val = int(x) * int(y) + int(c) if op == "*" else int(x) + int(y) + int(c)
      assert val == 10 * int(k) + int(dgt), col
    assert tasks.check(ex, f"<think>...</think>{a * b}") and not tasks.check(ex, f"<think>...</think>{a * b + 1}")
  assert tasks.parse_mixture("long")[0].family == "longmul"


def test_large_number_default_is_addition():
  for d in range(6, 13):
    ex = arithmetic.generate(3, d)
    assert ex["metadata"]["op"] == "+" and len(str(ex["metadata"]["a"])) == d


@pytest.mark.parametrize(
  "completion,ok",
  [
    ("<think>7+5+0=12,4+8+1=13,3+2+1=06</think>632", True),
    ("<think>whatever</think> 632 ", True),
    ("632", True),
    ("<think>a</think>x</think>632\nmore text", True),
    ("<think>7+5+0=12</think>633", False),
    ("<think>7+5+0=12 632", False),  # reasoning never closed: no answer
    ("<think>x</think>632abc", False),
    ("<think>x</think>6 32", False),
    ("<think>x</think>", False),
    ("", False),
    ("<think>x</think>-632", False),
  ],
)
def test_arithmetic_checker(completion, ok):
  meta = dict(op="+", a=347, b=285)
  assert arithmetic.check(meta, completion) is ok


def test_arithmetic_checker_negative_and_bad_metadata():
  assert arithmetic.check(dict(op="-", a=3, b=5), "</think>-2")
  with pytest.raises(ValueError, match="op"):
    arithmetic.check(dict(op="/", a=3, b=5), "1")
  with pytest.raises(ValueError, match="metadata"):
    arithmetic.check(dict(a=3), "1")


@pytest.mark.parametrize(
  "expr,ok",
  [
    ("(7*3)+5", True),
    ("7*3+5", True),
    ("3*7+5", True),
    ("5+3*7", True),
    (" ( 7 * 3 ) + 5 ", True),
    ("((7*3))+5", True),
    ("7*3+5+5", False),  # 5 used twice
    ("7*3+6", False),  # 6 not given
    ("26", False),  # not a given number
    ("(7+3)*5", False),  # wrong value (50)
    ("7*3+5=26", False),
    ("(7*3)+5)", False),
    ("((7*3)+5", False),
    ("", False),
    ("7*/3+5", False),
    ("-5+31", False),
    ("7*3+05", False),
    ("21/3", False),
    ("__import__('os').system('true')", False),
  ],
)
def test_countdown_checker(expr, ok):
  meta = dict(numbers=[3, 7, 5], target=26)
  assert countdown.check(meta, "<think>7*3=21,21+5=26</think>" + expr) is ok


def test_countdown_duplicates_and_subsets():
  meta = dict(numbers=[6, 6, 2], target=36)
  assert countdown.check(meta, "6*6")
  assert countdown.check(dict(numbers=[6, 6, 2], target=72), "6*6*2")
  assert not countdown.check(dict(numbers=[6, 6, 2], target=216), "6*6*6")
  assert countdown.evaluate("2*(3+4)-5") == (9, [2, 3, 4, 5])  # independent: 2*7-5 = 9
  with pytest.raises(SyntaxError):
    countdown.evaluate("2**3")


def test_countdown_generator_uses_all_numbers():
  for n in countdown.DIFFICULTIES:
    for s in range(10):
      ex = countdown.generate(s, n)
      meta = ex["metadata"]
      value, used = countdown.evaluate(ex["answer"].split("</think>")[1])
      assert value == meta["target"] and sorted(used) == sorted(meta["numbers"]) and len(used) == n
      assert all(1 <= x <= (10 if n <= 3 else 20) for x in meta["numbers"])
      assert ex["prompt"] == f"Make {meta['target']} from " + " ".join(map(str, meta["numbers"]))


def _search_tries(answer):
  """The tries of a countdown_search answer as lists of (a, op, b, c) steps, with each miss's '<' / '>' target."""
  body = answer[len("<think>") : answer.index("</think>")]
  tries = []
  for t in body.split(";"):
    m = re.fullmatch(r"(.*?)(?:([<>])(\d+))?", t)
    steps = [re.fullmatch(r"(\d+)([-+*])(\d+)=(\d+)", x).groups() for x in m.group(1).split(",")]
    tries.append(([(int(a), op, int(b), int(c)) for a, op, b, c in steps], m.group(2), m.group(3)))
  return tries


def test_countdown_search_answers_are_true_searches():
  """Every step is true (checked by Python's own arithmetic); each miss uses all the numbers, ends off the target
  and compares its value with it correctly; the last try hits the target; the problem, split and final expression
  are countdown's for the same seed."""
  ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
  misses = collections.Counter()
  for n in countdown_search.DIFFICULTIES:
    for s in range(60):
      split = "test" if s % 5 == 0 else "train"
      ex, ref = countdown_search.generate(s, n, split), countdown.generate(s, n, split)
      assert {k: ex[k] for k in ("prompt", "metadata", "difficulty")} == {
        k: ref[k] for k in ("prompt", "metadata", "difficulty")
      }
      assert ex["family"] == "countdown_search" and tasks.check(ex, ex["answer"])
      assert ex["answer"].split("</think>")[1] == ref["answer"].split("</think>")[1]
      target, numbers = ex["metadata"]["target"], sorted(ex["metadata"]["numbers"])
      tries = _search_tries(ex["answer"])
      misses[len(tries) - 1] += 1
      assert len({str(t) for t in tries}) == len(tries)  # no try repeated
      for k, (steps, cmp, stated) in enumerate(tries):
        assert all(ops[op](a, b) == c for a, op, b, c in steps), steps
        assert all(steps[i][3] == steps[i + 1][0] for i in range(len(steps) - 1))  # left-deep: a chain
        assert sorted([steps[0][0]] + [b for _, _, b, _ in steps]) == numbers
        value = steps[-1][3]
        if k < len(tries) - 1:
          assert int(stated) == target and value != target and cmp == (">" if value > target else "<")
        else:
          assert cmp is None and value == target
  assert set(misses) == set(range(countdown_search.MAX_MISSES + 1)), misses  # 0..3 misses all occur
  assert countdown_search.canonical(ex["metadata"]) == countdown.canonical(ex["metadata"])
  assert [c.family for c in tasks.parse_mixture("countdown_search:3")] == ["countdown_search"]


def test_splits_disjoint_by_construction():
  for family, d, v in SETTINGS:
    if family == "arithmetic" and v is not None and d > 4:
      continue
    task = tasks.get_task(family)
    train = {task.canonical(task.generate(s, d, "train", v)["metadata"]) for s in range(60)}
    test = {task.canonical(task.generate(s, d, "test", v)["metadata"]) for s in range(60)}
    assert not train & test, (family, d, v)
    assert all(base.split_of(c) == "train" for c in train) and all(base.split_of(c) == "test" for c in test)


def test_split_fraction_and_tiny_problem_space():
  frac = sum(base.split_of(f"arithmetic:{i}+{i}") == "test" for i in range(5000)) / 5000
  assert abs(frac - base.TEST_FRACTION) < 0.02
  # 1-digit additions: only 100 problems; the held-out ones are never produced for train, and vice versa.
  test = {arithmetic.canonical(arithmetic.generate(s, 1, "test", "+")["metadata"]) for s in range(300)}
  train = {arithmetic.canonical(arithmetic.generate(s, 1, "train", "+")["metadata"]) for s in range(300)}
  allp = {f"arithmetic:{a}+{b}" for a in range(10) for b in range(10)}
  assert test == {c for c in allp if base.split_of(c) == "test"}  # all found, none missing
  assert not test & train


@pytest.mark.parametrize(
  "kwargs,field",
  [
    (dict(seed=0, difficulty=0), "difficulty"),
    (dict(seed=0, difficulty=13), "difficulty"),
    (dict(seed=0, difficulty=2.0), "difficulty"),
    (dict(seed=0, difficulty=2, split="dev"), "split"),
    (dict(seed=0, difficulty=2, variant="/"), "variant"),
    (dict(seed="x", difficulty=2), "seed"),
  ],
)
def test_bad_generator_arguments(kwargs, field):
  with pytest.raises(ValueError, match=field):
    arithmetic.generate(**kwargs)


def test_extract_answer():
  assert base.extract_answer("<think>a</think>b") == "b"
  assert base.extract_answer("<think>a") is None
  assert base.extract_answer(" 42 ") == "42"
  with pytest.raises(ValueError, match="completion"):
    base.extract_answer(None)


def test_mixture_parsing_and_sampling():
  mix = tasks.parse_mixture("arithmetic/+:2-4:3,countdown:3")
  assert mix == (
    tasks.MixtureComponent("arithmetic", (2, 3, 4), 3.0, "+"),
    tasks.MixtureComponent("countdown", (3,), 1.0, None),
  )
  assert tasks.parse_mixture("default") == tasks.DEFAULT_MIXTURE
  for bad in ("arithmetic", "nope:2", "arithmetic:0", "countdown:3:-1", "arithmetic/%:2", "arithmetic:x"):
    with pytest.raises(ValueError):
      tasks.parse_mixture(bad)
  exs = [tasks.sample_example(mix, 7, i) for i in range(400)]
  assert exs[:20] == [tasks.sample_example(mix, 7, i) for i in range(20)]
  counts = collections.Counter(ex["family"] for ex in exs)
  assert 0.65 < counts["arithmetic"] / 400 < 0.85  # weight 3:1
  assert {ex["difficulty"] for ex in exs if ex["family"] == "arithmetic"} == {2, 3, 4}
  assert all(
    tasks.split_of(tasks.get_task(e["family"]).canonical(e["metadata"])) == "test"
    for e in (tasks.sample_example(mix, 7, i, "test") for i in range(50))
  )


def test_register_task():
  class Echo:
    FAMILY, DIFFICULTIES, VARIANTS = "echo_test", (1,), (None,)

    @staticmethod
    def generate(seed, difficulty, split="train", variant=None):
      return dict(
        prompt=f"say {seed}", answer=f"<think></think>{seed}", family="echo_test", difficulty=1, metadata=dict(v=seed)
      )

    @staticmethod
    def check(meta, completion):
      return base.extract_answer(completion) == str(base.metadata_of(meta)["v"])

    canonical = staticmethod(lambda meta: f"echo:{meta['v']}")

  tasks.register_task(Echo)
  try:
    ex = tasks.generate("echo_test", 4, 1)
    assert tasks.check(ex, "</think>4") and not tasks.check(ex, "</think>5")
    with pytest.raises(ValueError, match="already"):
      tasks.register_task(Echo)
  finally:
    tasks._TASKS.pop("echo_test")
  with pytest.raises(ValueError, match="unknown task family"):
    tasks.get_task("echo_test")
  with pytest.raises(ValueError, match="lacks"):
    tasks.register_task(object())
