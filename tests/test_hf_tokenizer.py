"""Hugging Face tokenizers and chat templates (data/hf_tokenizer.py), the locally made fixture (fixtures.py), the
tokenizer a run picks, model.hf_dir resolution and the export (hf.py): against jinja2 itself, transformers (where
installed) and hand-written renderings."""

import json
import os
import shutil

import jax
import jinja2
import jinja2.ext
import numpy as np
import pytest
from safetensors.numpy import load_file

import hf_reference
import stepflash_jax as sfj
from stepflash_jax import hf
from stepflash_jax.config import model_config
from stepflash_jax.data import HFTokenizer, Tokenizer, load_tokenizer, load_tokenizer_dir, tokenizer_for
from stepflash_jax.fixtures import make_fixture

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def _call(name, **arguments):
  return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
  "plain": [{"role": "user", "content": "Compute 12+30"}],
  "thinking": [
    {"role": "user", "content": "Add 3 and 4"},
    {"role": "assistant", "reasoning_content": "3+4=7", "content": "7"},
  ],
  "tools": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12*7 and 3**4?"},
    {
      "role": "assistant",
      "reasoning_content": "two calls",
      "content": "",
      "tool_calls": [_call("calc", expression="12*7"), _call("calc", expression="3**4", digits=2)],
    },
    {"role": "tool", "content": "84"},
    {"role": "tool", "content": "81"},
    {"role": "assistant", "reasoning_content": "both known", "content": "84 and 81"},
  ],
  "multi_turn": [
    {"role": "user", "content": "Compute 5-2"},
    {"role": "assistant", "reasoning_content": "5-2=3", "content": "3"},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "reasoning_content": "3*4=12", "content": "12"},
  ],
  "unicode": [{"role": "user", "content": "Übersetze «hello» — 你好 ✓"}],
}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
  return make_fixture(str(tmp_path_factory.mktemp("fixture")))


@pytest.fixture(scope="module")
def tok(fixture_dir):
  return load_tokenizer_dir(fixture_dir)


def plain_jinja(template, **context):
  """An independent render: a fresh jinja2 environment configured as transformers configures chat templates."""
  env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)

  def raise_exception(msg):
    raise jinja2.TemplateError(msg)

  env.globals["raise_exception"] = raise_exception
  return env.from_string(template).render(**context)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_render_equals_jinja_and_round_trips(tok, name, generation_prompt):
  msgs, tools = CONVERSATIONS[name], [CALC] if name == "tools" else None
  text = tok.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tools=tools)
  template = json.load(open(os.path.join(tok.directory, "tokenizer_config.json")))["chat_template"]
  ref = plain_jinja(
    template, messages=msgs, tools=tools, add_generation_prompt=generation_prompt, bos_token=tok.bos_token,
    eos_token=tok.eos_token,
  )  # fmt: skip
  assert text == ref
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert all(0 <= i < tok.vocab_size for i in ids)


def test_renderings_have_the_released_shape(tok):
  """Hand-written expectations: ChatML turns, reasoning kept only after the last user turn, XML tool calls, tool
  results grouped in one user turn, the generation prompt opening <think>."""
  r = lambda name, g=False: tok.apply_chat_template(CONVERSATIONS[name], add_generation_prompt=g)
  assert r("plain", True) == "<|im_start|>user\nCompute 12+30<|im_end|>\n<|im_start|>assistant\n<think>\n"
  assert r("thinking") == (
    "<|im_start|>user\nAdd 3 and 4<|im_end|>\n<|im_start|>assistant\n<think>\n3+4=7\n</think>\n7<|im_end|>\n"
  )
  multi = r("multi_turn")
  assert "5-2=3" not in multi and "<think>\n3*4=12\n</think>\n12<|im_end|>" in multi
  assert multi.startswith("<|im_start|>user\nCompute 5-2<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n")
  tools = tok.apply_chat_template(CONVERSATIONS["tools"], tools=[CALC])
  assert '<tools>\n{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}\n</tools>' in (
    tools
  )
  assert (
    "<think>\ntwo calls\n</think>\n<tool_call>\n<function=calc>\n<parameter=expression>\n12*7\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=calc>\n<parameter=expression>\n3**4\n</parameter>\n"
    "<parameter=digits>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
  ) in tools
  assert "<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n81\n</tool_response><|im_end|>" in (
    tools
  )
  with pytest.raises(jinja2.TemplateError, match="system message must come first"):
    tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_matches_transformers(tok):
  transformers = pytest.importorskip("transformers")
  ref = transformers.AutoTokenizer.from_pretrained(tok.directory)
  for name, msgs in CONVERSATIONS.items():
    tools = [CALC] if name == "tools" else None
    for g in (False, True):
      text = tok.apply_chat_template(msgs, add_generation_prompt=g, tools=tools)
      assert text == ref.apply_chat_template(msgs, add_generation_prompt=g, tools=tools, tokenize=False)
      assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
  assert tok.eos_id == ref.eos_token_id and tok.pad_id == ref.pad_token_id


def test_format_example_and_prompt(tok):
  ids, mask = tok.format_example("Add 3 and 4", "<think>3+4=7</think>7")
  prompt = tok.format_prompt("Add 3 and 4")
  assert list(ids[: len(prompt)]) == prompt and not mask[: len(prompt)].any() and mask[len(prompt) :].all()
  assert ids[-1] == tok.eos_id and list(ids[len(prompt) :]).count(tok.eos_id) == 1  # the answer ends at its eos
  assert tok.decode(ids) == tok.apply_chat_template(CONVERSATIONS["thinking"]).removesuffix("\n")
  assert tok.decode(ids[len(prompt) :], stop_at_eos=True) == "3+4=7\n</think>\n7"
  # padding and ids beyond the tokenizer (a model vocab padded past it) decode to nothing
  assert tok.decode(np.r_[prompt, tok.pad_id, tok.vocab_size + 3]) == tok.format_prompt_text("Add 3 and 4")


def test_the_directory_picks_the_tokenizer(tok, fixture_dir, tmp_path):
  assert isinstance(tok, HFTokenizer)
  sp = load_tokenizer()
  shutil.copyfile(sp.model_path, tmp_path / "tokenizer.model")
  assert isinstance(load_tokenizer_dir(str(tmp_path)), Tokenizer)
  with pytest.raises(ValueError, match="no tokenizer"):
    load_tokenizer_dir(str(tmp_path / "missing"))
  bad = tmp_path / "bad"
  shutil.copytree(fixture_dir, bad)
  cfg = json.load(open(bad / "tokenizer_config.json"))
  json.dump({**cfg, "eos_token": "<|nope|>"}, open(bad / "tokenizer_config.json", "w"))
  with pytest.raises(ValueError, match="field 'eos_token'"):
    load_tokenizer_dir(str(bad))
  json.dump({k: v for k, v in cfg.items() if k != "chat_template"}, open(bad / "tokenizer_config.json", "w"))
  with pytest.raises(ValueError, match="'chat_template'"):
    load_tokenizer_dir(str(bad))
  json.dump({**cfg, "chat_template": "{% for m in messages %}\n{{ m.content"}, open(bad / "tokenizer_config.json", "w"))
  with pytest.raises(ValueError, match=r"tokenizer_config.json: the chat template is not valid Jinja \(line 2: "):
    load_tokenizer_dir(str(bad))  # at load time, not at the first prompt
  json.dump([cfg], open(bad / "tokenizer_config.json", "w"))
  with pytest.raises(ValueError, match="tokenizer_config.json: must be a JSON object, got a list"):
    load_tokenizer_dir(str(bad))


def _run_config(**model):
  import ml_collections

  return ml_collections.ConfigDict(
    {"model": model_config(**model), "data": {"tokenizer_dir": "", "tokenizer_families": ("arithmetic",)}}
  )


def test_resolve_model_and_tokenizer_for(fixture_dir, tok):
  c = _run_config(vocab_size=512, attention_impl="reference", hf_dir=fixture_dir)
  hf.resolve_model(c)
  stored = json.load(open(os.path.join(fixture_dir, "config.json")))
  assert c.model.vocab_size == stored["vocab_size"] == tok.vocab_size
  assert c.model.num_layers == stored["num_hidden_layers"] and c.model.hidden_size == stored["hidden_size"]
  assert c.model.attention_impl == "reference" and c.model.hf_dir == fixture_dir  # the config's switches stay
  assert c.model.param_dtype == "float32"
  assert isinstance(tokenizer_for(c), HFTokenizer)
  with pytest.raises(ValueError, match="model.hf_dir"):
    hf.resolve_model(_run_config(hf_dir=os.path.join(fixture_dir, "nope")))
  small = _run_config(vocab_size=100)
  small.data.tokenizer_dir = fixture_dir  # a tokenizer directory without hf_dir
  with pytest.raises(ValueError, match="model.vocab_size"):
    tokenizer_for(small)


def test_export_reloads_with_identical_logits(fixture_dir, tok, tmp_path):
  cfg, v = sfj.load_hf_checkpoint(fixture_dir)
  v = jax.tree.map(lambda x: x * 1.5, v)  # not the fixture's weights
  out = hf.export(cfg, v, tok, str(tmp_path / "hf"))
  hf.export(cfg, v, tok, out)  # overwriting a previous export
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no temporary directories left
  cfg2, v2 = sfj.load_hf_checkpoint(out)
  ids = np.asarray([tok.format_prompt("Compute 12+30")], np.int32)
  np.testing.assert_array_equal(sfj.forward(cfg, v, ids), sfj.forward(cfg2, v2, ids))
  tok2 = load_tokenizer_dir(out)
  assert tok2.encode("Compute 12+30") == tok.encode("Compute 12+30") and tok2.chat_template == tok.chat_template
  # The exported files read by the independent float64 NumPy model of the released code (tests/hf_reference.py).
  W = load_file(os.path.join(out, "model.safetensors"))
  ref, _ = hf_reference.forward(W, json.load(open(os.path.join(out, "config.json"))), ids[0])
  np.testing.assert_allclose(sfj.forward(cfg2, v2, ids)[0], ref, rtol=2e-4, atol=2e-4)


def test_exports_side_by_side_do_not_collide(fixture_dir, tok, tmp_path):
  """Several processes may export to one directory at once (RL seeds reusing one SFT run): each export writes its
  own temporary directory, every call succeeds, one whole export is left and no temporary directory."""
  import concurrent.futures

  cfg, v = sfj.load_hf_checkpoint(fixture_dir)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    outs = list(pool.map(lambda _: hf.export(cfg, v, tok, str(tmp_path / "hf")), range(4)))
  assert set(outs) == {str(tmp_path / "hf")} and sorted(os.listdir(tmp_path)) == ["hf"]
  ids = np.asarray([tok.format_prompt("Compute 12+30")], np.int32)
  np.testing.assert_array_equal(sfj.forward(cfg, v, ids), sfj.forward(*sfj.load_hf_checkpoint(outs[0]), ids))
