"""Optimisers: StepFun Muon (Polar Express, fp16) + AdamW for embeddings / heads / 1-D params."""

from stepflash_jax.optim.muon import (
  MuonDims,
  MuonState,
  assignment_summary,
  matrix_shape,
  muon,
  muon_dims,
  orthogonalize,
  orthogonalize_matrices,
  param_dims,
  polar_express,
  polar_express_coeffs,
  scale_by_stepfun_muon,
)

__all__ = [
  "MuonDims",
  "MuonState",
  "assignment_summary",
  "matrix_shape",
  "muon",
  "muon_dims",
  "orthogonalize",
  "orthogonalize_matrices",
  "param_dims",
  "polar_express",
  "polar_express_coeffs",
  "scale_by_stepfun_muon",
]
