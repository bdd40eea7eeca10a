"""The `implementation=` switch shared by the ops: its names and its default, the ops' one platform check."""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("reference", "xla", "pallas")


def resolve_implementation(implementation):
  """None -> "pallas" on a TPU backend, "xla" elsewhere; anything but IMPLEMENTATIONS raises ValueError."""
  if implementation is None:
    return "pallas" if jax.default_backend() == "tpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be 'reference', 'xla', 'pallas' or None, got {implementation!r}")
  return implementation
