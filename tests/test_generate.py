"""experiments/generate.py on the tiny HF fixture (stepflash_jax.fixtures): the streamed Python decode loop against
the uncached forward's argmax chain and the engine's own sampler, MTP against plain decoding, the reasoning split
against the chat template, and the CLI end to end (prompt mode, chat, bad flags) in subprocesses."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import stepflash_jax as sfj
from experiments import generate as gen
from stepflash_jax.data.hf_tokenizer import load_tokenizer_dir
from stepflash_jax.sampling import RolloutEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "generate.py")
N = 12  # new tokens everywhere (one set of compiled programs)


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
  from stepflash_jax.fixtures import make_fixture

  d = make_fixture(str(tmp_path_factory.mktemp("tiny_step")))
  cfg, variables = sfj.load_hf_checkpoint(d)
  tok = load_tokenizer_dir(d)
  with open(os.path.join(d, "prompts.jsonl")) as f:
    question = json.loads(f.readline())["prompt"]
  return d, cfg, variables, tok, question


@pytest.fixture(scope="module")
def greedy(fixture):
  _, cfg, variables, tok, question = fixture
  ids = gen.chat_prompt_ids(tok, [{"role": "user", "content": question}])
  pieces = []
  out = gen.complete(cfg, variables, tok, ids, temperature=0.0, top_p=1.0, max_new_tokens=N, seed=0,
                     on_text=pieces.append)  # fmt: skip
  return ids, out, pieces


def run_cli(*args, stdin=None):
  return subprocess.run([sys.executable, SCRIPT, *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_greedy_equals_forward_argmax_chain(fixture, greedy):
  """Prefill + cached steps reproduce the argmax of the uncached fp32 forward at the last position, token by token
  (one right-padded buffer: a causal model's logits at t do not see the padding after t)."""
  _, cfg, variables, tok, _ = fixture
  ids, out, pieces = greedy
  assert len(out) == N and tok.eos_id not in out
  buf = np.full((1, len(ids) + N), tok.pad_id, np.int32)
  buf[0, : len(ids)] = ids
  want = []
  for k in range(N):
    t = int(np.argmax(np.asarray(sfj.forward(cfg, variables, buf))[0, len(ids) + k - 1]))
    want.append(t)
    buf[0, len(ids) + k] = t
  assert out == want
  assert "".join(pieces) == tok.decode(out)  # the streamed deltas add up to the answer


def test_sampling_matches_engine(fixture):
  """temperature / top-p: the Python loop draws the tokens RolloutEngine.generate draws with the same key."""
  _, cfg, variables, tok, _ = fixture
  ids = gen.chat_prompt_ids(tok, [{"role": "user", "content": "hello"}])
  kw = dict(temperature=0.7, top_p=0.9, max_new_tokens=N)
  out = gen.complete(cfg, variables, tok, ids, seed=5, **kw)
  eng = RolloutEngine(cfg, max_prompt_len=gen.MIN_WIDTH, eos_id=tok.eos_id, pad_id=tok.pad_id, dtype="float32", **kw)
  res = jax.device_get(eng.generate(variables, np.asarray([ids]), np.asarray([len(ids)]), jax.random.key(5)))
  ref = res["response"][0, : res["lengths"][0]].tolist()
  assert out == [t for t in ref if t != tok.eos_id]
  assert out != gen.complete(cfg, variables, tok, ids, seed=6, **kw)  # the seed matters


def test_mtp_greedy_equals_plain(fixture, greedy):
  _, cfg, variables, tok, _ = fixture
  ids, out, _ = greedy
  pieces = []
  got = gen.complete(cfg, variables, tok, ids, temperature=0.0, top_p=1.0, max_new_tokens=N, seed=1, mtp=True,
                     on_text=pieces.append)  # fmt: skip
  assert got == out and pieces == [tok.decode(out)]  # printed once, per call


def test_assistant_message_renders_back(fixture):
  """The generated "R\\n</think>\\nC" becomes {reasoning_content R, content C}; the template renders it back to
  prompt + generated text + end of turn."""
  tok = fixture[3]
  user = [{"role": "user", "content": "hi"}]
  prompt = tok.apply_chat_template(user, add_generation_prompt=True)
  msg = gen.assistant_message(prompt, "two\nlines\n</think>\nThe answer: 4")
  assert msg == {"role": "assistant", "reasoning_content": "two\nlines", "content": "The answer: 4"}
  assert tok.apply_chat_template(user + [msg]) == prompt + "two\nlines\n</think>\nThe answer: 4" + tok.eos_token + "\n"
  assert gen.assistant_message(prompt, "cut off") == {
    "role": "assistant",
    "reasoning_content": "cut off",
    "content": "",
  }
  assert gen.assistant_message("<|user|>hi<|assistant|>", "plain") == {"role": "assistant", "content": "plain"}


def test_complete_rejects_bad_arguments(fixture):
  _, cfg, variables, tok, _ = fixture
  kw = dict(temperature=0.0, top_p=1.0, max_new_tokens=4, seed=0)
  for bad, match in ((dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")):
    with pytest.raises(ValueError, match=match):
      gen.complete(cfg, variables, tok, [1, 2], **{**kw, **bad})
  with pytest.raises(ValueError, match="prompt_ids"):
    gen.complete(cfg, variables, tok, [], **kw)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    gen.complete(cfg, variables, tok, [1] * cfg.max_position_embeddings, **kw)


def test_cli_prompt_mode_prints_the_answer(fixture, greedy):
  d, _, _, tok, question = fixture
  r = run_cli("--checkpoint", d, "--prompt", question, "--temperature", "0", "--max_new_tokens", str(N))
  assert r.returncode == 0, r.stderr
  assert r.stdout == tok.decode(greedy[1]) + "\n"


def test_cli_chat_two_turns_and_reset(fixture):
  """Two turns separated by /reset: the second answer is the answer to "hello" alone (the conversation was cleared)."""
  d, cfg, variables, tok, _ = fixture
  r = run_cli("--checkpoint", d, "--temperature", "0", "--max_new_tokens", str(N), stdin="hi\n/reset\nhello\n")
  assert r.returncode == 0, r.stderr
  assert r.stderr.count(" new tokens in ") == 2
  ids = gen.chat_prompt_ids(tok, [{"role": "user", "content": "hello"}])
  hello = tok.decode(gen.complete(cfg, variables, tok, ids, temperature=0.0, top_p=1.0, max_new_tokens=N, seed=0))
  assert r.stdout.startswith("> ") and "(conversation cleared)\n> " + hello + "\n> " in r.stdout


def test_cli_bad_flags(fixture, capsys):
  d = fixture[0]
  r = run_cli("--checkpoint", d, "--top_p", "0")
  assert r.returncode != 0 and "--top_p" in r.stderr
  for args, flag in (
    (["--checkpoint", os.path.join(d, "missing")], "--checkpoint"),
    (["--checkpoint", d, "--temperature", "-1"], "--temperature"),
    (["--checkpoint", d, "--top_p", "1.5"], "--top_p"),
    (["--checkpoint", d, "--prompt", " "], "--prompt"),
    (["--checkpoint", d, "--dtype", "float16"], "--dtype"),
  ):
    with pytest.raises(SystemExit) as e:
      gen.main(args)
    assert e.value.code != 0 and flag in capsys.readouterr().err
