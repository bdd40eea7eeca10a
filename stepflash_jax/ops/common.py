"""The `implementation=` switch shared by the ops: its names and its default, the ops' one platform check."""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("reference", "xla", "pallas")


def resolve_implementation(implementation, gpu: str = "xla"):
  """None -> "pallas" on a TPU backend, `gpu` on a GPU backend (the op's measured winner there), "xla" on CPU;
  anything but IMPLEMENTATIONS raises ValueError."""
  if implementation is None:
    backend = jax.default_backend()
    return "pallas" if backend == "tpu" else gpu if backend == "gpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be 'reference', 'xla', 'pallas' or None, got {implementation!r}")
  return implementation
