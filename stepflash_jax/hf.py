"""Hugging Face checkpoint interop: safetensors in the released Step3p5 layout <-> our variables.

Torch Linear weights are [out, in]; our kernels are [in..., out...] (experts: [E, in, out]). Norm weights are w
of the 1 + w convention on both sides. MTP module k is HF layer `num_layers + k`. Scanned layers are un/stacked.
`load(save(x))` reproduces x exactly: dtypes are kept as stored (config.param_dtype follows them), except that the
router's weight and bias are always read as fp32.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import jax.numpy as jnp
from flax import linen as nn
from safetensors import SafetensorError, safe_open
from safetensors.flax import load_file, save_file

from stepflash_jax import config as config_lib
from stepflash_jax import model as model_lib
from stepflash_jax.data.hf_tokenizer import tokenizer_files
from stepflash_jax.files import read_json

# (our sub-path inside a decoder layer, HF suffix, number of leading batch axes, number of input axes or None=copy)
_LAYER = [
  (("params", "input_norm", "scale"), "input_layernorm.weight", 0, None),
  (("params", "post_attn_norm", "scale"), "post_attention_layernorm.weight", 0, None),
  (("params", "attn", "q_proj", "kernel"), "self_attn.q_proj.weight", 0, 1),
  (("params", "attn", "k_proj", "kernel"), "self_attn.k_proj.weight", 0, 1),
  (("params", "attn", "v_proj", "kernel"), "self_attn.v_proj.weight", 0, 1),
  (("params", "attn", "g_proj", "kernel"), "self_attn.g_proj.weight", 0, 1),
  (("params", "attn", "o_proj", "kernel"), "self_attn.o_proj.weight", 0, 2),
  (("params", "attn", "q_norm", "scale"), "self_attn.q_norm.weight", 0, None),
  (("params", "attn", "k_norm", "scale"), "self_attn.k_norm.weight", 0, None),
]
_DENSE = [((("params", "mlp", p, "kernel")), f"mlp.{p}.weight", 0, 1) for p in ("gate_proj", "up_proj", "down_proj")]
_MOE = (
  [
    (("params", "moe", "router", "kernel"), "moe.gate.weight", 0, 1),
    (("router", "moe", "router_bias"), "moe.router_bias", 0, None),
  ]
  + [(("params", "moe", p, "kernel"), f"moe.{p}.weight", 1, 1) for p in ("gate_proj", "up_proj", "down_proj")]
  + [
    (("params", "moe", "shared", p, "kernel"), f"share_expert.{p}.weight", 0, 1)
    for p in ("gate_proj", "up_proj", "down_proj")
  ]
)


def layout(args):
  """[(hf_name, collection, path tuple in that collection, stack index or None, batch axes, input axes)]."""
  out = []

  def add(hf, full, stack, nb, nin):
    out.append((hf, full[0], full[1:], stack, nb, nin))

  start, period, n = args.scan if args.scan else (len(args.layers), 0, 0)
  for i, spec in enumerate(args.layers):
    if start <= i < start + period * n:
      prefix, stack = ("blocks", f"sub_{(i - start) % period}"), (i - start) // period
    else:
      prefix, stack = (f"layer_{i}",), None
    for sub, hf, nb, nin in _LAYER + (_MOE if spec.moe else _DENSE):
      add(f"model.layers.{i}.{hf}", (sub[0],) + prefix + sub[1:], stack, nb, nin)
  add("model.embed_tokens.weight", ("params", "embed", "embedding"), None, 0, None)
  add("model.norm.weight", ("params", "final_norm", "scale"), None, 0, None)
  add("lm_head.weight", ("params", "lm_head", "kernel"), None, 0, 1)
  for k in range(len(args.mtp_layers)):
    base, m = f"model.layers.{len(args.layers) + k}", f"mtp_{k}"
    add(f"{base}.enorm.weight", ("params", m, "enorm", "scale"), None, 0, None)
    add(f"{base}.hnorm.weight", ("params", m, "hnorm", "scale"), None, 0, None)
    add(f"{base}.eh_proj.weight", ("params", m, "eh_proj", "kernel"), None, 0, 1)
    add(f"{base}.transformer.shared_head.norm.weight", ("params", m, "final_norm", "scale"), None, 0, None)
    add(f"{base}.transformer.shared_head.output.weight", ("params", m, "head", "kernel"), None, 0, 1)
    for sub, hf, nb, nin in _LAYER + _DENSE:
      add(f"{base}.{hf}", (sub[0], m, "layer") + sub[1:], None, nb, nin)
  return out


def _to_hf(x, nb, nin):
  if nin is None:
    return x
  s = x.shape
  x = x.reshape(s[:nb] + (math.prod(s[nb : nb + nin]), math.prod(s[nb + nin :])))
  return jnp.swapaxes(x, -1, -2)


def _hf_shape(shape, nb, nin):
  if nin is None:
    return tuple(shape)
  return tuple(shape[:nb]) + (math.prod(shape[nb + nin :]), math.prod(shape[nb : nb + nin]))


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def save_hf_checkpoint(cfg, variables, path: str, max_shard_bytes: int = 4 << 30) -> None:
  """Write config.json + model.safetensors (or shards + model.safetensors.index.json) in the HF layout."""
  if isinstance(cfg, config_lib.ModelArgs):
    raise ValueError("save_hf_checkpoint: cfg must be the model ConfigDict (it is written as config.json)")
  args = model_lib.as_args(cfg)
  os.makedirs(path, exist_ok=True)
  tensors = {}
  for hf, col, p, stack, nb, nin in layout(args):
    x = _get(variables[col], p)
    tensors[hf] = jnp.asarray(_to_hf(x if stack is None else x[stack], nb, nin))
  hf_cfg = config_lib.to_hf_config(cfg)
  shards, cur, size = [], {}, 0
  for name, t in tensors.items():
    if cur and size + t.nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = {}, 0
    cur[name], size = t, size + t.nbytes
  shards.append(cur)
  tmp = path + ".tmp_write"
  os.makedirs(tmp, exist_ok=True)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
  else:
    weight_map = {}
    for s, shard in enumerate(shards):
      fn = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(tmp, fn), metadata={"format": "pt"})
      weight_map.update({k: fn for k in shard})
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
      json.dump(
        {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, f, indent=1
      )
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=1)
  for fn in os.listdir(tmp):  # files land complete: each is renamed into place after being written
    os.replace(os.path.join(tmp, fn), os.path.join(path, fn))
  os.rmdir(tmp)


def export(cfg, variables, tok, directory: str) -> str:
  """A checkpoint directory others can load: save_hf_checkpoint + the tokenizer's files (tokenizer.json and
  tokenizer_config.json, or the SentencePiece tokenizer.model). Written next to `directory` and renamed into place:
  a crash leaves the previous export or none, never half of one."""
  directory = os.path.abspath(directory)
  parent, base = os.path.split(directory)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=base + ".tmp_export.", dir=parent)  # per process: exports may run side by side
  try:
    save_hf_checkpoint(cfg, variables, tmp)
    for name, src in tokenizer_files(tok).items():
      shutil.copyfile(src, os.path.join(tmp, name))
    for _ in range(3):  # another export may land between the two renames: move it aside and try again
      old = tmp + ".old"
      if os.path.exists(directory):
        os.replace(directory, old)
      try:
        os.replace(tmp, directory)
        break
      except OSError:
        if not os.path.isdir(directory):
          raise
      finally:
        shutil.rmtree(old, ignore_errors=True)
    else:
      raise OSError(f"{directory}: other exports kept replacing it; none of this one's 3 attempts landed")
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return directory


def _read_tensors(path: str) -> dict:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      files = sorted(set(read_json(index)["weight_map"].values()))
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' of tensor -> file): {e!r}") from e
  else:
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
  if not files:
    raise ValueError(f"{path}: no *.safetensors files")
  tensors = {}
  for fn in files:
    try:
      tensors.update(load_file(os.path.join(path, fn)))
    except (SafetensorError, OSError) as e:  # e.g. a truncated download: "incomplete metadata"
      raise ValueError(f"{os.path.join(path, fn)}: cannot read the safetensors file ({e})") from e
  return tensors


def _stored_dtype(path: str) -> str | None:
  """The one dtype of the checkpoint's non-router tensors (read from the safetensors headers only), else None."""
  dtypes = set()
  for fn in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
    with safe_open(os.path.join(path, fn), framework="numpy") as f:
      dtypes |= {str(f.get_slice(k).get_dtype()).lower() for k in f.keys() if "router" not in k and "gate.w" not in k}
  names = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
  return names.get(dtypes.pop(), None) if len(dtypes) == 1 else None


def _model_config(path: str):
  """The model ConfigDict of `path`/config.json; ValueError naming the file when it is malformed or not Step3p5."""
  cfg_file = os.path.join(path, "config.json")
  hf_cfg = read_json(cfg_file)
  try:
    return config_lib.from_hf_config(hf_cfg)
  except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
    raise ValueError(f"{cfg_file}: not a valid Step 3.5 Flash config ({type(e).__name__}: {e})") from e


def resolve_model(config):
  """With config.model.hf_dir set: config.model becomes the checkpoint's architecture (its config.json) and stored
  param dtype, keeping the config's numerics and implementation switches (dtype, attention_impl, moe_impl,
  scan_layers, remat, expert_parallel, context_full). Changes `config` in place and returns it; a no-op otherwise."""
  hf_dir = config.model.get("hf_dir", "")
  if not hf_dir:
    return config
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    raise ValueError(
      f"config field 'model.hf_dir': {hf_dir!r} has no config.json (a Hugging Face checkpoint directory)"
    )
  model = _model_config(hf_dir)
  for key in config_lib.IMPL_KEYS + ("init_std", "hf_dir"):
    model[key] = config.model[key]
  model.param_dtype = _stored_dtype(hf_dir) or config.model.param_dtype
  with config.unlocked():
    config.model = model
  return config


def load_hf_checkpoint(path: str, **config_overrides):
  """Directory with config.json + *.safetensors (single or sharded) -> (cfg, variables). A malformed config.json, an
  unreadable (e.g. truncated) safetensors file or a tensor that is missing, unexpected, of the wrong shape or not
  floating-point raises ValueError naming it. cfg.param_dtype is the stored dtype when the non-router tensors share
  one, else the config's (float32); every leaf is cast to it, the router to float32."""
  cfg = _model_config(path)
  tensors = _read_tensors(path)
  for name, t in sorted(tensors.items()):
    if not jnp.issubdtype(t.dtype, jnp.floating):
      raise ValueError(f"{path}: tensor '{name}' has dtype {t.dtype}, expected a floating-point dtype")
  dtypes = {str(t.dtype) for n, t in tensors.items() if "router" not in n and "gate.weight" not in n}
  if len(dtypes) == 1:
    cfg.param_dtype = dtypes.pop()
  config_lib.override(cfg, config_overrides)
  args = config_lib.model_args(cfg)
  with nn.logical_axis_rules(()):  # shapes only: no sharding constraints under a mesh (parallel.use_mesh)
    abstract = model_lib.abstract_variables(args)
  entries = layout(args)
  expected = {hf for hf, *_ in entries}
  missing = sorted(expected - set(tensors))
  extra = sorted(set(tensors) - expected)
  if missing:
    raise ValueError(
      f"{path}: missing tensor '{missing[0]}'" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
    )
  if extra:
    raise ValueError(
      f"{path}: unexpected tensor '{extra[0]}'" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "")
    )
  staged = {}
  for hf, col, p, stack, nb, nin in entries:
    leaf = _get(abstract[col], p)
    shape = leaf.shape if stack is None else leaf.shape[1:]
    want = _hf_shape(shape, nb, nin)
    t = tensors[hf]
    if tuple(t.shape) != want:
      raise ValueError(f"tensor '{hf}' has shape {tuple(t.shape)}, expected {want}")
    x = t if nin is None else jnp.swapaxes(t, -1, -2).reshape(shape)
    # one dtype for all (a checkpoint of mixed dtypes keeps cfg.param_dtype); the router is fp32 whatever is stored
    x = jnp.asarray(x, jnp.float32 if col == "router" or "router" in p else cfg.param_dtype)
    staged.setdefault((col, p), {})[stack] = x
  variables = {}
  for (col, p), parts in staged.items():
    x = parts[None] if None in parts else jnp.stack([parts[b] for b in range(len(parts))])
    _set(variables, (col,) + p, x)
  return cfg, variables
