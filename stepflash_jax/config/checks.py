"""Validation of the model ConfigDict: one ValueError naming the field, before anything is built."""

from __future__ import annotations

from stepflash_jax.config.defaults import FULL, IMPLEMENTATIONS, SWA


class ConfigError(ValueError):
  """A config field that does not fit what is on disk, found when a run starts (e.g. a reused run of another
  length); experiments/run.py prints it as one line, like the checks before the run."""


def _check(cond: bool, field: str, msg: str):
  if not cond:
    raise ValueError(f"model config field '{field}': {msg}")


def validate(c) -> None:
  """Raise a one-line ValueError naming the first bad field."""
  for f in (
    "vocab_size",
    "hidden_size",
    "head_dim",
    "num_layers",
    "num_heads",
    "num_heads_swa",
    "num_kv_heads",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
  ):
    _check(int(c[f]) > 0, f, f"must be > 0, got {c[f]}")
  _check(c.num_mtp_layers >= 0, "num_mtp_layers", f"must be >= 0, got {c.num_mtp_layers}")
  _check(
    c.sliding_window is not None and c.sliding_window > 0, "sliding_window", f"must be > 0, got {c.sliding_window}"
  )
  n = c.num_layers + c.num_mtp_layers
  for f in ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared"):
    _check(len(c[f]) == n, f, f"needs num_layers + num_mtp_layers = {n} entries, got {len(c[f])}")
  for i, t in enumerate(c.layer_types):
    _check(t in (FULL, SWA), "layer_types", f"entry {i} is {t!r}; expected {FULL!r} or {SWA!r}")
  for i, p in enumerate(c.partial_rotary_factors):
    rot = p * c.head_dim
    _check(
      0 < p <= 1 and rot == int(rot) and int(rot) % 2 == 0,
      "partial_rotary_factors",
      f"entry {i} = {p} must give an even rotary dim <= head_dim {c.head_dim}",
    )
  _check(all(t > 0 for t in c.rope_theta), "rope_theta", "every theta must be > 0")
  for f in ("num_heads", "num_heads_swa"):
    _check(c[f] % c.num_kv_heads == 0, f, f"{c[f]} is not a multiple of num_kv_heads={c.num_kv_heads}")
  _check(
    c.num_experts_per_tok <= c.num_experts,
    "num_experts_per_tok",
    f"top-k {c.num_experts_per_tok} > num_experts {c.num_experts}",
  )
  _check(all(0 <= i < c.num_layers for i in c.moe_layers), "moe_layers", f"indices must lie in [0, {c.num_layers})")
  _check(
    all(x >= 0 for x in list(c.swiglu_limits) + list(c.swiglu_limits_shared)),
    "swiglu_limits",
    "limits must be >= 0 (0 = no clamp)",
  )
  if c.rope_scaling is not None:
    rs = c.rope_scaling
    _check(
      rs.get("rope_type", "llama3") == "llama3",  # no scaling is rope_scaling=None
      "rope_scaling.rope_type",
      f"only 'llama3' is supported, got {rs.get('rope_type')!r}",
    )
    _check(
      rs["high_freq_factor"] > rs["low_freq_factor"], "rope_scaling.high_freq_factor", "must exceed low_freq_factor"
    )
  _check(c.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
  _check(c.attention_impl in IMPLEMENTATIONS, "attention_impl", f"one of {IMPLEMENTATIONS}, got {c.attention_impl!r}")
  _check(c.moe_impl in IMPLEMENTATIONS, "moe_impl", f"one of {IMPLEMENTATIONS}, got {c.moe_impl!r}")
  full = c.get("context_full", "ring")
  _check(full in ("ring", "all_gather"), "context_full", f"one of ('ring', 'all_gather'), got {full!r}")
  for f in ("dtype", "param_dtype"):
    _check(c[f] in ("float32", "bfloat16", "float16"), f, f"unsupported dtype {c[f]!r}")
  if "expert_parallel" in c:
    try:
      parse_expert_parallel(c.expert_parallel)
    except ValueError as e:
      _check(False, "expert_parallel", str(e))


EXPERT_PARALLEL = ("none", "auto", "gather", "a2a", "ragged")  # strategies of model/moe_parallel.py


def parse_expert_parallel(mode: str | None) -> tuple[str, float | None]:
  """'ragged:1.5' -> ('ragged', 1.5); None/'' -> ('none', None); ValueError for unknown strategies."""
  mode = (mode or "none").strip()
  name, _, cf = mode.partition(":")
  if name not in EXPERT_PARALLEL:
    raise ValueError(
      f"expert_parallel must be one of {EXPERT_PARALLEL} (optionally ':<capacity factor>'), got {mode!r}"
    )
  if cf:
    try:
      cf = float(cf)
    except ValueError:
      raise ValueError(f"expert_parallel capacity factor must be a number, got {mode!r}") from None
    if cf <= 0:
      raise ValueError(f"expert_parallel capacity factor must be > 0, got {mode!r}")
  return name, (cf or None)
