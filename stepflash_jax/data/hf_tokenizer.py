"""Tokenizers in the Hugging Face layout (docs/data.md §2): tokenizer.json + the chat template of tokenizer_config.json.

A checkpoint directory holds either
    tokenizer.json + tokenizer_config.json     -> HFTokenizer (the `tokenizers` library; the chat template rendered
                                                  by jinja2 exactly as transformers renders it)
    tokenizer.model (SentencePiece)            -> data/tokenizer.Tokenizer (the project's own chat format)
and `load_tokenizer_dir` picks by what is there. Both expose the interface the trainers use: vocab_size, pad_id,
bos_id, eos_id, encode, decode, format_prompt, format_example.

With a chat template, one SFT example is the rendering of [user prompt, assistant answer] cut after the first eos:
    prompt ids   = encode(template(messages=[user], add_generation_prompt=True))
    example ids  = encode(template(messages=[user, assistant], add_generation_prompt=False)) up to the first eos,
                   loss_mask 1 on the ids after the prompt
where an answer "<think>R</think>C" becomes the assistant message {reasoning_content: R, content: C}. The rendered
conversation must start with the rendered prompt (a template whose generation prompt differs from the start of its
assistant turn is reported, naming the template).
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stepflash_jax.data.tasks.base import THINK_CLOSE, THINK_OPEN
from stepflash_jax.files import read_json
from stepflash_jax.data.tokenizer import DEFAULT_FAMILIES, Tokenizer, load_tokenizer

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
SP_FILE = "tokenizer.model"


def _token_text(value) -> str | None:
  """A special token of tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
  return value.get("content") if isinstance(value, dict) else value


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
  """The template compiled as transformers compiles chat templates: a sandbox, trim_blocks + lstrip_blocks,
  loop controls, a `tojson` filter keeping non-ASCII text, `raise_exception` and `strftime_now` globals."""

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
  return env.from_string(source)


def split_answer(answer: str) -> dict:
  """'<think>R</think>C' -> {"role": "assistant", "reasoning_content": R, "content": C} (no think span: content)."""
  if answer.startswith(THINK_OPEN) and THINK_CLOSE in answer:
    reasoning, content = answer[len(THINK_OPEN) :].split(THINK_CLOSE, 1)
    return {"role": "assistant", "reasoning_content": reasoning, "content": content}
  return {"role": "assistant", "content": answer}


class HFTokenizer:
  """tokenizer.json (byte-level BPE or any `tokenizers` model) with the chat template of tokenizer_config.json (or
  chat_template.jinja). eos = the config's eos_token (the end of an assistant turn in chat models); pad = pad_token,
  else eos (padding is masked by segment ids everywhere, its id never matters)."""

  def __init__(self, directory: str):
    path, cfg_path = os.path.join(directory, TOKENIZER_FILE), os.path.join(directory, CONFIG_FILE)
    for p in (path, cfg_path):
      if not os.path.isfile(p):
        raise ValueError(
          f"{directory}: no {os.path.basename(p)} (a Hugging Face tokenizer needs {TOKENIZER_FILE} + {CONFIG_FILE})"
        )
    try:
      self.tk = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust error type is not exported
      raise ValueError(f"{path}: cannot read the tokenizer ({e})") from e
    self.directory, self.config = directory, read_json(cfg_path)
    if not isinstance(self.config, dict):
      raise ValueError(f"{cfg_path}: must be a JSON object, got a {type(self.config).__name__}")
    template_path = os.path.join(directory, TEMPLATE_FILE)
    template, source = self.config.get("chat_template"), cfg_path
    if os.path.isfile(template_path):
      with open(template_path) as f:
        template, source = f.read(), template_path
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      template = {t["name"]: t["template"] for t in template}.get("default")
    if not isinstance(template, str):
      raise ValueError(f"{cfg_path}: field 'chat_template' must be a template string (or {TEMPLATE_FILE})")
    try:
      compile_template(template)
    except jinja2.TemplateSyntaxError as e:  # found here, not at the first prompt
      raise ValueError(f"{source}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
    self.chat_template = template
    self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
    self.bos_token, self.eos_token = (
      _token_text(self.config.get("bos_token")),
      _token_text(self.config.get("eos_token")),
    )
    self.bos_id = self._special_id("bos_token", required=False)
    self.eos_id = self._special_id("eos_token", required=True)
    pad = self._special_id("pad_token", required=False)
    self.pad_id = self.eos_id if pad is None else pad
    self.unk_id = self._special_id("unk_token", required=False)

  def _special_id(self, field: str, required: bool) -> int | None:
    text = _token_text(self.config.get(field))
    if text is None:
      if required:
        raise ValueError(f"{os.path.join(self.directory, CONFIG_FILE)}: field '{field}' is required")
      return None
    i = self.tk.token_to_id(text)
    if i is None:
      raise ValueError(
        f"{os.path.join(self.directory, CONFIG_FILE)}: field '{field}' = {text!r} is not in {TOKENIZER_FILE}"
      )
    return i

  @property
  def special_ids(self) -> dict[str, int]:
    return {k: v for k, v in (("pad", self.pad_id), ("bos", self.bos_id), ("eos", self.eos_id)) if v is not None}

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special tokens written in the text (e.g. '<|im_start|>') are their own ids."""
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    return self.tk.encode(text, add_special_tokens=False).ids

  def decode(self, ids, *, stop_at_eos: bool = False) -> str:
    """Text of `ids` [T]; padding and ids the tokenizer does not know (a model vocab padded beyond the tokenizer's)
    decode to ''. With stop_at_eos only the ids before the first eos."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1:
      raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
    if stop_at_eos:
      hits = np.flatnonzero(ids == self.eos_id)
      ids = ids[: hits[0]] if hits.size else ids
    ids = ids[(ids >= 0) & (ids < self.vocab_size) & (ids != self.pad_id)]
    return self.tk.decode(ids.tolist(), skip_special_tokens=False)

  def id_to_piece(self, i: int) -> str:
    return self.tk.id_to_token(int(i)) or ""

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = False, tools=None, **kwargs) -> str:
    """The template's text for `messages` (dicts with role / content / reasoning_content / tool_calls)."""
    return compile_template(self.chat_template).render(
      messages=messages,
      tools=tools,
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token or "",
      eos_token=self.eos_token or "",
      **kwargs,
    )

  def format_prompt_text(self, prompt: str) -> str:
    return self.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)

  def format_prompt(self, prompt: str) -> list[int]:
    """Ids of the one-user-turn conversation with the generation prompt: ready for the assistant's answer."""
    return self.encode(self.format_prompt_text(prompt))

  def format_example(self, prompt: str, answer: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T] int32, loss_mask [T] float32): [user, assistant] rendered, cut after the first eos of the answer;
    loss_mask 1 on the answer's ids (see the module docstring)."""
    head = self.format_prompt_text(prompt)
    full = self.apply_chat_template([{"role": "user", "content": prompt}, split_answer(answer)])
    if not full.startswith(head):
      raise ValueError(
        f"{self.directory}: the chat template's generation prompt {head[-40:]!r} is not the start of its assistant "
        f"turn {full[len(head) - 40 : len(head) + 10]!r}; SFT targets cannot be aligned with generation"
      )
    p, rest = self.encode(head), self.encode(full[len(head) :])
    if self.eos_id in rest:
      rest = rest[: rest.index(self.eos_id) + 1]
    else:
      rest = rest + [self.eos_id]
    return np.asarray(p + rest, np.int32), np.asarray([0.0] * len(p) + [1.0] * len(rest), np.float32)


def load_tokenizer_dir(directory: str):
  """The tokenizer a checkpoint directory holds: tokenizer.json (+ tokenizer_config.json) -> HFTokenizer,
  tokenizer.model -> the SentencePiece Tokenizer; a directory with neither raises ValueError naming it."""
  if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
    return HFTokenizer(directory)
  if os.path.isfile(os.path.join(directory, SP_FILE)):
    return Tokenizer(os.path.join(directory, SP_FILE))
  raise ValueError(f"{directory}: no tokenizer ({TOKENIZER_FILE} + {CONFIG_FILE}, or a SentencePiece {SP_FILE})")


def tokenizer_for(config):
  """The run's tokenizer: model.hf_dir's (HF or SentencePiece), else data.tokenizer_dir when it holds a tokenizer,
  else the locally trained SentencePiece model for data.tokenizer_families (cached in data.tokenizer_dir or the
  package cache). Its vocabulary must fit the model's."""
  hf_dir, tok_dir = config.model.get("hf_dir", ""), config.data.get("tokenizer_dir", "")
  if hf_dir:
    tok = load_tokenizer_dir(hf_dir)
  elif tok_dir and any(os.path.isfile(os.path.join(tok_dir, f)) for f in (TOKENIZER_FILE, SP_FILE)):
    tok = load_tokenizer_dir(tok_dir)
  else:
    families = tuple(config.data.get("tokenizer_families", DEFAULT_FAMILIES))  # + their SYMBOLS (tool calls)
    tok = load_tokenizer(tok_dir or None, vocab_size=config.model.vocab_size, families=families)
  if tok.vocab_size > config.model.vocab_size:
    raise ValueError(
      f"the tokenizer has {tok.vocab_size} tokens > config field 'model.vocab_size' = {config.model.vocab_size}"
    )
  return tok


def tokenizer_files(tok) -> dict[str, str]:
  """{file name in a checkpoint directory: source path} of a tokenizer (what an export copies)."""
  if isinstance(tok, HFTokenizer):
    names = (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE)
    return {n: os.path.join(tok.directory, n) for n in names if os.path.isfile(os.path.join(tok.directory, n))}
  return {SP_FILE: tok.model_path}
