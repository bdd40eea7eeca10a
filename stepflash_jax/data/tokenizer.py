"""SentencePiece tokenizer trained locally on the task families, and the chat template.

Training (reproducible, nothing downloaded): BPE on a corpus of prompts and reference answers generated with
fixed seeds from every built-in family / difficulty / variant; digits are single pieces (split_digits), the chat
markers and the math symbols + - * = , ( ) are user-defined pieces (always one token each), identity
normalisation and no dummy prefix so decode(encode(text)) == text exactly, byte fallback for unseen characters.
If the corpus yields fewer pieces than `vocab_size`, the vocab is filled up with unused control pieces
'<|reserved_k|>' so vocab_size is exactly the requested size.

Fixed ids: pad 0, unk 1, bos 2, eos 3, <|user|> 4, <|assistant|> 5, <think> 6, </think> 7.

Chat template (no newlines, no spaces around the markers):
    prompt ids   = [bos] <|user|> {prompt} <|assistant|>            format_prompt
    example ids  = prompt ids + {answer} + [eos]                       format_example, loss_mask 1 on answer+eos
where an answer is "<think>...</think>final".
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from stepflash_jax.caches import cache_dir
from stepflash_jax.checks import is_int
from stepflash_jax.files import atomic_write
from stepflash_jax.data import tasks

USER, ASSISTANT = "<|user|>", "<|assistant|>"
SYSTEM, TOOL = "<|system|>", "<|tool|>"  # multi-turn conversations (agents/chat.py)
THINK_OPEN, THINK_CLOSE = tasks.base.THINK_OPEN, tasks.base.THINK_CLOSE
CHAT_SYMBOLS = (USER, ASSISTANT, THINK_OPEN, THINK_CLOSE)
MATH_SYMBOLS = ("+", "-", "*", "=", ",", "(", ")")
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
DEFAULT_VOCAB_SIZE = 512
DEFAULT_FAMILIES = ("arithmetic", "countdown")
CORPUS_EXAMPLES_PER_SETTING = 100
_VERSION = 1  # bump when the training recipe changes: it is part of the cached file name


def default_cache_dir() -> str:
  """$STEPFLASH_CACHE/tokenizer, default ~/.cache/stepflash_jax/tokenizer."""
  return cache_dir("tokenizer")


def corpus(
  families: Sequence[str] = DEFAULT_FAMILIES, examples_per_setting: int = CORPUS_EXAMPLES_PER_SETTING
) -> list[str]:
  """Training lines: prompt and answer of `examples_per_setting` train examples per (family, difficulty,
  variant), seeds 0..n-1. Deterministic."""
  lines = []
  for family in families:
    task = tasks.get_task(family)
    for difficulty in task.DIFFICULTIES:
      for variant in task.VARIANTS:
        for seed in range(examples_per_setting):
          ex = task.generate(seed, difficulty, split="train", variant=variant)
          lines += [ex["prompt"], ex["answer"]]
  return lines


def symbols(families: Sequence[str] = DEFAULT_FAMILIES) -> tuple[str, ...]:
  """The user-defined pieces (always one token each): chat markers, math symbols, then those the families declare
  (a family module's optional SYMBOLS, e.g. the tool-call template of agents/toolmul.py)."""
  extra = [s for f in families for s in getattr(tasks.get_task(f), "SYMBOLS", ())]
  return CHAT_SYMBOLS + MATH_SYMBOLS + tuple(dict.fromkeys(extra))


def _train_proto(lines: Iterable[str], vocab_size: int, pieces: Sequence[str] = CHAT_SYMBOLS + MATH_SYMBOLS) -> bytes:
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines),
    model_writer=buf,
    vocab_size=vocab_size,
    model_type="bpe",
    character_coverage=1.0,
    byte_fallback=True,
    split_digits=True,
    add_dummy_prefix=False,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    hard_vocab_limit=False,
    pad_id=PAD_ID,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    user_defined_symbols=list(pieces),
    num_threads=1,
    minloglevel=2,
  )
  return buf.getvalue()


def train_tokenizer(
  model_path: str,
  *,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
  families: Sequence[str] = DEFAULT_FAMILIES,
  lines: Sequence[str] | None = None,
) -> str:
  """Trains the SentencePiece model on `lines` (default `corpus(families)`) with the families' `symbols` and
  writes it atomically to `model_path`."""
  if not is_int(vocab_size) or vocab_size < 300:
    raise ValueError(f"vocab_size must be an int >= 300 (256 byte pieces + specials), got {vocab_size!r}")
  lines = corpus(families) if lines is None else lines
  model = sp_pb2.ModelProto.FromString(_train_proto(lines, vocab_size, symbols(families)))
  for k in range(vocab_size - len(model.pieces)):  # fill up to exactly vocab_size with unused control pieces
    model.pieces.add(piece=f"<|reserved_{k}|>", score=0.0, type=sp_pb2.ModelProto.SentencePiece.CONTROL)
  proto = model.SerializeToString(deterministic=True)
  return atomic_write(model_path, proto)


def model_filename(
  vocab_size: int = DEFAULT_VOCAB_SIZE, lines: Sequence[str] | None = None, pieces: Sequence[str] = ()
) -> str:
  """Cache file name: a hash of the recipe version, vocab size, extra user-defined pieces and the corpus itself, so
  a change of any task generator retrains instead of loading a stale model."""
  h = hashlib.sha256(f"v{_VERSION}:{vocab_size}".encode() + "".join(f"|{p}" for p in pieces).encode())
  for line in corpus() if lines is None else lines:
    h.update(line.encode() + b"\n")
  return f"sp_{vocab_size}_{h.hexdigest()[:12]}.model"


def load_tokenizer(
  cache_dir: str | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE, families: Sequence[str] = DEFAULT_FAMILIES
) -> "Tokenizer":
  """The tokenizer cached in `cache_dir` (default `default_cache_dir()`), training it first if missing."""
  lines = corpus(families)
  extra = symbols(families)[len(CHAT_SYMBOLS + MATH_SYMBOLS) :]
  path = os.path.join(cache_dir or default_cache_dir(), model_filename(vocab_size, lines, extra))
  if not os.path.exists(path):
    train_tokenizer(path, vocab_size=vocab_size, families=families, lines=lines)
  return Tokenizer(path)


class Tokenizer:
  """SentencePiece wrapper with the chat template. Loaded from a model file path."""

  def __init__(self, model_path: str):
    if not os.path.isfile(model_path):
      raise ValueError(f"model_path {model_path!r} is not a file")
    self.model_path = model_path
    self.sp = spm.SentencePieceProcessor(model_file=model_path)
    self.vocab_size = self.sp.vocab_size()
    self.pad_id, self.unk_id, self.bos_id, self.eos_id = (
      self.sp.pad_id(),
      self.sp.unk_id(),
      self.sp.bos_id(),
      self.sp.eos_id(),
    )
    self.user_id, self.assistant_id, self.think_id, self.end_think_id = (self.sp.piece_to_id(s) for s in CHAT_SYMBOLS)
    expected = (PAD_ID, UNK_ID, BOS_ID, EOS_ID, 4, 5, 6, 7)
    got = (
      self.pad_id,
      self.unk_id,
      self.bos_id,
      self.eos_id,
      self.user_id,
      self.assistant_id,
      self.think_id,
      self.end_think_id,
    )
    if got != expected:
      raise ValueError(f"model_path {model_path!r} has special ids {got}, expected {expected}")

  @property
  def special_ids(self) -> dict[str, int]:
    return {
      "pad": self.pad_id,
      "unk": self.unk_id,
      "bos": self.bos_id,
      "eos": self.eos_id,
      USER: self.user_id,
      ASSISTANT: self.assistant_id,
      THINK_OPEN: self.think_id,
      THINK_CLOSE: self.end_think_id,
    }

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no bos/eos added)."""
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    return self.sp.encode(text)

  def decode(self, ids, *, stop_at_eos: bool = False) -> str:
    """Text of `ids` (list or 1-D array). pad/bos/eos/reserved pieces decode to ''; with stop_at_eos only the
    ids before the first eos are decoded."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1:
      raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
    if stop_at_eos:
      hits = np.flatnonzero(ids == self.eos_id)
      if hits.size:
        ids = ids[: hits[0]]
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise ValueError(f"ids must be in [0, {self.vocab_size}), got range [{ids.min()}, {ids.max()}]")
    return self.sp.decode(ids.tolist())

  def id_to_piece(self, i: int) -> str:
    return self.sp.id_to_piece(int(i))

  @staticmethod
  def format_prompt_text(prompt: str) -> str:
    return f"{USER}{prompt}{ASSISTANT}"

  def format_prompt(self, prompt: str) -> list[int]:
    """[bos, <|user|>, prompt..., <|assistant|>]: ready for generation of the assistant turn."""
    return [self.bos_id, self.user_id] + self.encode(prompt) + [self.assistant_id]

  def format_example(self, prompt: str, answer: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T] int32, loss_mask [T] float32): the prompt, then answer + eos; loss_mask is 1 exactly on the
    assistant's tokens (answer and eos) and 0 on bos, the user turn and the <|assistant|> marker. A multi-turn
    answer "A1<|tool|>R1<|assistant|>A2..." holds tool messages: "<|tool|>R<|assistant|>" is encoded as the
    rollout engine appends it (encode("<|tool|>R") + the assistant id) and has loss_mask 0."""
    ids, mask = list(self.format_prompt(prompt)), [0.0] * len(self.format_prompt(prompt))
    first, *turns = answer.split(TOOL)
    parts = [(self.encode(first), 1.0)]
    for turn in turns:
      result, _, own = turn.partition(ASSISTANT)
      parts += [(self.encode(TOOL + result) + [self.assistant_id], 0.0), (self.encode(own), 1.0)]
    for part, m in parts + [([self.eos_id], 1.0)]:
      ids += part
      mask += [m] * len(part)
    return np.asarray(ids, np.int32), np.asarray(mask, np.float32)
