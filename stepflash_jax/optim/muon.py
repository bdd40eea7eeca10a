"""Muon, StepFun's Step 3.5 Flash variant (docs/training.md §1), with AdamW for embeddings / heads / 1-D params.

Muon update for one matrix parameter W (all math in fp32 unless stated):
    buf  = 0.95 * buf + g                       (momentum, fp32 state)
    g'   = g + 0.95 * buf                       (Nesterov)
    O    = orthogonalize(g')                    (6 Polar Express steps in float16, or classic Newton-Schulz)
    W   <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(rows, cols)) * O
Orthogonalisation of a matrix G [rows, cols]: X = G / (||G||_F * 1.01 + 1e-7), transposed so rows <= cols;
per step A = X X^T, X = a X + (b A + c A^2) X; transposed back.

Parameters of any rank are viewed as a batch of matrices through `MuonDims` (reduction axes -> matrix rows,
output axes -> matrix cols, every other axis is a batch axis orthogonalised independently). Batch axes are
never merged or gathered: the iteration is written with `...` einsums, so an expert axis sharded over devices
stays sharded. Which parameter is Muon / AdamW is decided by `muon_dims` (path + shape), see its docstring.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

# Polar Express (Amsel et al. 2025) per-step (a, b, c): the six rows the Step 3.5 Flash report §2 lists (the first six
# of the reference code's list for l = 1e-3, cushion 0.02, NoahAmsel/PolarExpress polar_express/basic.py, and of
# StepFun's SteptronOss steptronoss/optimizer/_helpers.py). Steps past them repeat POLAR_EXPRESS_LATER, the converged
# quintic, unscaled (the report's "later" row; the reference list's 7th row is that quintic up to 2e-6).
POLAR_EXPRESS_TABLE = (
  (8.28721201814563, -23.595886519098837, 17.300387312530933),
  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
  (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
)
POLAR_EXPRESS_LATER = (1.875, -1.25, 0.375)
# Which steps the safety factor divides: "reference" (default) every table row, only the repeated LATER entry is
# unscaled -- what the Polar Express reference code and StepFun's open training code run, so with 6 steps all six
# are scaled. "last_step_unscaled": every step except the last one run (6 steps: row 6 unscaled) -- the paper's
# generator `optimal_composition(num_iters=steps)` does this when the list is built for exactly `steps` iterations;
# kept as an ablation switch (optim.pe_safety), not the default, because the published schedule is the former.
PE_SAFETY_SCHEDULES = ("reference", "last_step_unscaled")
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, same (a, b, c) every step
_DTYPES = {"float16": jnp.float16, "float32": jnp.float32, "bfloat16": jnp.bfloat16}
_METHODS = ("polar_express", "newton_schulz")


class MuonDims(NamedTuple):
  """Matrix view of a parameter: rows = prod(shape[reduction_axes]), cols = prod(shape[output_axes]).

  Axes in neither tuple are batch axes (one independent matrix per batch index). `output_split`, if given,
  splits the flattened cols into chunks of those sizes (a fused matrix), each orthogonalised and scaled on its own.
  """

  reduction_axes: tuple[int, ...]
  output_axes: tuple[int, ...]
  output_split: tuple[int, ...] | None = None


def _is_dims(x) -> bool:
  return x is None or isinstance(x, MuonDims)


# ----------------------------------------------------------------------------------------------------------------
# Orthogonalisation
# ----------------------------------------------------------------------------------------------------------------
def polar_express_coeffs(
  steps: int = 6, safety: float = 1.01, schedule: str = "reference"
) -> tuple[tuple[float, float, float], ...]:
  """Per-step (a, b, c): the table rows, then POLAR_EXPRESS_LATER; a scaled step is (a/s, b/s^3, c/s^5).

  schedule "reference" (default): every table row is scaled, the LATER entry never (the reference code's list:
  scale all but its last, converged, polynomial, then repeat that one). "last_step_unscaled": every step but the
  last one run is scaled, whichever row it is (see PE_SAFETY_SCHEDULES).
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  if schedule not in PE_SAFETY_SCHEDULES:
    raise ValueError(f"schedule must be one of {PE_SAFETY_SCHEDULES}, got {schedule!r}")
  n = len(POLAR_EXPRESS_TABLE)
  rows = [POLAR_EXPRESS_TABLE[i] if i < n else POLAR_EXPRESS_LATER for i in range(steps)]
  scaled = (lambda i: i < n) if schedule == "reference" else (lambda i: i < steps - 1)
  return tuple(
    (a / safety, b / safety**3, c / safety**5) if scaled(i) else (a, b, c) for i, (a, b, c) in enumerate(rows)
  )


def _coeffs(method: str, steps: int | None, pe_safety: str = "reference") -> tuple[tuple[float, float, float], ...]:
  if method == "polar_express":
    return polar_express_coeffs(6 if steps is None else steps, schedule=pe_safety)
  if method == "newton_schulz":
    steps = 5 if steps is None else steps
    if steps < 1:
      raise ValueError(f"ns_steps must be >= 1, got {steps}")
    return (NEWTON_SCHULZ_COEFFS,) * steps
  raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def _dtype(ortho_dtype) -> Any:
  if isinstance(ortho_dtype, str):
    if ortho_dtype not in _DTYPES:
      raise ValueError(f"ortho_dtype must be one of {tuple(_DTYPES)}, got {ortho_dtype!r}")
    return _DTYPES[ortho_dtype]
  return jnp.dtype(ortho_dtype)


def _mm(x, y, dtype, spec):
  """Batched matmul in `dtype` with fp32 accumulation, result rounded back to `dtype` (like tensor cores)."""
  return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32).astype(dtype)


def _type_spec(x) -> tuple:
  """Sharding spec in x's type (non-None only for Explicit mesh axes; Auto/GSPMD sharding is not in types)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (x.ndim - len(spec))


def _reshard(x, spec: tuple):
  if spec == _type_spec(x):
    return x
  mesh = jax.typeof(x).sharding.mesh
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def orthogonalize_matrices(
  g: jax.Array,
  *,
  method: str = "polar_express",
  ns_steps: int | None = None,
  ortho_dtype="float16",
  norm_safety: float | None = None,
  eps: float = 1e-7,
  pe_safety: str = "reference",
) -> jax.Array:
  """g [..., rows, cols] -> O [..., rows, cols] (fp32) ~ U V^T of each trailing matrix (leading axes = batch).

  X = G / (||G||_F * norm_safety + eps) (norm in fp32; norm_safety default 1.01 for polar_express, 1.0 for
  newton_schulz), transposed so rows <= cols, then per step A = X X^T, X = a X + (b A + c A^2) X in ortho_dtype.
  pe_safety: which Polar Express steps the 1.01 safety factor divides (`polar_express_coeffs` schedule).
  """
  if g.ndim < 2:
    raise ValueError(f"g must have rank >= 2, got shape {g.shape}")
  coeffs = _coeffs(method, ns_steps, pe_safety)
  dtype = _dtype(ortho_dtype)
  if norm_safety is None:
    norm_safety = 1.01 if method == "polar_express" else 1.0
  x = g.astype(jnp.float32)
  spec = _type_spec(x)
  if any(a is not None for a in spec[-2:]):  # Explicit sharding of a matrix dim: gather that one matrix only
    x = _reshard(x, spec[:-2] + (None, None))
  transposed = x.shape[-2] > x.shape[-1]
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  x = (x / (norm * norm_safety + eps)).astype(dtype)

  def step(x, abc):  # tensors stored in `dtype`, scalar-times-tensor sums in fp32 (like torch's opmath)
    a, b, c = abc[0], abc[1], abc[2]
    gram = _mm(x, x, dtype, "...ik,...jk->...ij")  # A = X X^T
    poly = (b * gram + c * _mm(gram, gram, dtype, "...ij,...jk->...ik")).astype(dtype)  # b A + c A^2
    return (a * x + _mm(poly, x, dtype, "...ij,...jk->...ik")).astype(dtype), None

  # a scan (not an unrolled loop) keeps the HLO, and so compile time for many parameters, small
  x, _ = jax.lax.scan(step, x, jnp.asarray(coeffs, jnp.float32))
  x = x.astype(jnp.float32)
  return jnp.swapaxes(x, -1, -2) if transposed else x


def polar_express(g: jax.Array, *, steps: int = 6, ortho_dtype="float16") -> jax.Array:
  """StepFun's orthogonaliser on [..., rows, cols]: 6 Polar Express steps, safety 1.01, float16."""
  return orthogonalize_matrices(g, method="polar_express", ns_steps=steps, ortho_dtype=ortho_dtype)


def _check_dims(shape: tuple[int, ...], dims: MuonDims):
  ndim = len(shape)
  red = tuple(int(a) % ndim if -ndim <= a < ndim else -1 for a in dims.reduction_axes)
  out = tuple(int(a) % ndim if -ndim <= a < ndim else -1 for a in dims.output_axes)
  if not red or not out or -1 in red + out or len(set(red + out)) != len(red + out):
    raise ValueError(
      f"dims {dims} invalid for a parameter of shape {shape}: reduction/output axes must be "
      "non-empty, in range and disjoint"
    )
  batch = tuple(a for a in range(ndim) if a not in red + out)
  rows, cols = math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)
  if dims.output_split is not None and (sum(dims.output_split) != cols or min(dims.output_split) < 1):
    raise ValueError(
      f"dims.output_split {dims.output_split} must be positive and sum to cols={cols} for a parameter of shape {shape}"
    )
  return batch, red, out, rows, cols


def matrix_shape(shape: Sequence[int], dims: MuonDims) -> tuple[tuple[int, ...], tuple[int, int]]:
  """(batch shape, (rows, cols)) of the matrix view of a parameter of `shape`."""
  shape = tuple(shape)
  batch, _, _, rows, cols = _check_dims(shape, dims)
  return tuple(shape[a] for a in batch), (rows, cols)


def orthogonalize(x: jax.Array, dims: MuonDims | None = None, *, rms_scale: float | None = None, **kwargs) -> jax.Array:
  """Orthogonalise every matrix slice of x (any rank) as given by dims (default: x is 2-D [rows, cols]).

  Returns fp32, same shape as x. If rms_scale is set each chunk is multiplied by rms_scale * sqrt(max(rows,
  cols)) of that chunk. kwargs go to `orthogonalize_matrices` (method, ns_steps, ortho_dtype, norm_safety, eps).
  """
  if dims is None:
    if x.ndim != 2:
      raise ValueError(f"x must be 2-D when dims is None, got shape {x.shape}")
    dims = MuonDims((0,), (1,))
  batch, red, out, rows, cols = _check_dims(x.shape, dims)
  perm = batch + red + out
  bshape = tuple(x.shape[a] for a in batch)
  m = jnp.transpose(x, perm).reshape(bshape + (rows, cols))
  splits = dims.output_split or (cols,)
  pieces, start = [], 0
  for n in splits:
    o = orthogonalize_matrices(m[..., start : start + n], **kwargs)
    if rms_scale is not None:
      o = o * (rms_scale * math.sqrt(max(rows, n)))
    pieces.append(o)
    start += n
  o = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)
  o = o.reshape(bshape + tuple(x.shape[a] for a in red + out))
  o = jnp.transpose(o, tuple(sorted(range(x.ndim), key=lambda i: perm[i])))
  spec = _type_spec(x)
  return _reshard(o, spec) if any(a is not None for a in spec) else o


# ----------------------------------------------------------------------------------------------------------------
# Which parameter is Muon, and its matrix view
# ----------------------------------------------------------------------------------------------------------------
def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _path_parts(path) -> list[str]:
  parts = [_key_str(k) for k in path]
  if parts and parts[-1] == "value":  # flax nn.Partitioned / LogicallyPartitioned boxes
    parts = parts[:-1]
  return parts


def param_dims(path: str | Sequence[str], shape: Sequence[int]) -> MuonDims | None:
  """The rule of `muon_dims` for one leaf: path ('a/b/c' or parts) and shape -> MuonDims or None (AdamW)."""
  parts = path.split("/") if isinstance(path, str) else list(path)
  shape = tuple(shape)
  if parts and parts[0] == "params":
    parts = parts[1:]
  leaf = parts[-1] if parts else ""
  parent = parts[-2] if len(parts) >= 2 else ""
  n = 1 if "blocks" in parts else 0  # scanned stack: leading "layers" axis is a batch axis
  core = len(shape) - n
  if "embed" in parts or "lm_head" in parts or leaf == "embedding":
    return None
  if parent == "head" and any(p.startswith("mtp_") for p in parts):
    return None
  if core <= 1:
    return None
  if (
    leaf == "kernel"
    and len(parts) >= 3
    and parts[-3] == "moe"
    and parent in ("gate_proj", "up_proj", "down_proj")
    and core == 3
  ):
    return MuonDims((n + 1,), (n + 2,))  # [E, in, out]: one matrix per expert
  if leaf == "kernel" and parent in ("q_proj", "k_proj", "v_proj") and core == 3:
    return MuonDims((n,), (n + 1, n + 2))  # [H, heads, D] -> [H, heads*D]
  if leaf == "kernel" and parent == "o_proj" and core == 3:
    return MuonDims((n, n + 1), (n + 2,))  # [heads, D, H] -> [heads*D, H]
  if core == 2:
    return MuonDims((n,), (n + 1,))  # [in, out]
  raise ValueError(f"muon_dims: no rule for parameter {'/'.join(parts)!r} of shape {shape}")


def muon_dims(params) -> Any:
  """Pytree like params: MuonDims (Muon) or None (AdamW) per leaf, decided by path and shape only.

  n = 1 under params/blocks/... (scanned stack, leading "layers" axis = batch axis), else 0; core = ndim - n.
  Rules in order (first match wins); batch axes = all axes not listed:

  | parameter (path / leaf)                              | shape (core)   | optimiser | rows x cols          |
  |------------------------------------------------------|----------------|-----------|----------------------|
  | embed/embedding                                      | [V, H]         | AdamW     | -                    |
  | lm_head/kernel                                       | [H, V]         | AdamW     | -                    |
  | mtp_k/head/kernel                                    | [H, V]         | AdamW     | -                    |
  | any leaf with core <= 1 (norm scales, biases)        | [H], [D]       | AdamW     | -                    |
  | moe/{gate,up,down}_proj/kernel (expert stacks)       | [E, in, out]   | Muon      | per expert in x out  |
  | attn/{q,k,v}_proj/kernel                             | [H, heads, D]  | Muon      | H x heads*D          |
  | attn/o_proj/kernel                                   | [Hq, D, H]     | Muon      | Hq*D x H             |
  | any other 2-D leaf (g_proj, mlp, shared expert,      | [in, out]      | Muon      | in x out             |
  |   moe/router/kernel, mtp eh_proj)                    |                |           |                      |
  | anything else                                        |                | ValueError naming path and shape  |

  e.g. blocks/sub_0/moe/down_proj [n_blocks, E, F, H] -> n_blocks*E matrices [F, H]. Works on any params pytree
  (dicts, FrozenDicts, boxed params, masked subtrees) and on jax.ShapeDtypeStruct leaves (jax.eval_shape).
  """
  return jax.tree_util.tree_map_with_path(lambda p, x: param_dims(_path_parts(p), x.shape), params)


def assignment_summary(params, dims_fn: Callable[[Any], Any] = muon_dims) -> dict[str, str]:
  """{'a/b/leaf': 'muon batch=(..) matrix=(rows, cols)' or 'adamw shape=(..)'} for every leaf of params."""
  dims = dims_fn(params)
  flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_d = jax.tree_util.tree_leaves(dims, is_leaf=_is_dims)
  out = {}
  for (path, x), d in zip(flat_p, flat_d, strict=True):
    name = "/".join(_path_parts(path))
    if d is None:
      out[name] = f"adamw shape={tuple(x.shape)}"
    else:
      b, mat = matrix_shape(x.shape, d)
      out[name] = f"muon batch={b} matrix={mat}"
  return out


# ----------------------------------------------------------------------------------------------------------------
# The optimiser
# ----------------------------------------------------------------------------------------------------------------
class MuonState(NamedTuple):
  count: jax.Array  # int32 [], steps taken (the LR schedule is evaluated at count before increment)
  momentum: Any  # fp32 buffers, one per Muon parameter


def scale_by_stepfun_muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  dims_fn: Callable[[Any], Any] = muon_dims,
  beta: float = 0.95,
  nesterov: bool = True,
  weight_decay: float = 0.1,
  rms_scale: float = 0.2,
  **ortho_kwargs,
) -> optax.GradientTransformation:
  """Full Muon step for trees whose leaves are all Muon params: u = -lr * (rms*sqrt(max)*O + wd * p).

  dims_fn(tree) -> MuonDims per leaf (it must accept masked subtrees, i.e. be path/shape based).
  """

  def init_fn(params):
    return MuonState(jnp.zeros([], jnp.int32), jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError("params must be given to update() when weight_decay != 0")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    dims = dims_fn(updates)
    momentum = jax.tree.map(lambda g, m: beta * m + g.astype(jnp.float32), updates, state.momentum)

    def one(g, m, d, p):
      if d is None:
        raise ValueError(f"muon update got a non-Muon leaf of shape {g.shape}")
      g32 = g.astype(jnp.float32)
      o = orthogonalize(g32 + beta * m if nesterov else m, d, rms_scale=rms_scale, **ortho_kwargs)
      if weight_decay:
        o = o + weight_decay * p.astype(jnp.float32)
      return (-lr * o).astype(g.dtype)

    ps = params if params is not None else jax.tree.map(lambda _: None, updates)
    new = jax.tree.map(lambda g, m, d, p: one(g, m, d, p), updates, momentum, dims, ps, is_leaf=lambda x: x is None)
    return new, MuonState(optax.safe_increment(state.count), momentum)

  return optax.GradientTransformation(init_fn, update_fn)


def _adamw_fp32(learning_rate, b1, b2, eps, weight_decay) -> optax.GradientTransformation:
  """optax.adamw with both moments in fp32 (also for bf16 params); updates cast to the gradient dtype."""
  inner = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mu_dtype=jnp.float32)

  def init_fn(params):
    return inner.init(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))

  def update_fn(updates, state, params=None):
    new, state = inner.update(updates, state, params)
    return jax.tree.map(lambda u, g: u.astype(g.dtype), new, updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  dims_fn: Callable[[Any], Any] = muon_dims,
  method: str = "polar_express",
  ns_steps: int | None = None,
  ortho_dtype="float16",
  beta: float = 0.95,
  nesterov: bool = True,
  weight_decay: float = 0.1,
  rms_scale: float = 0.2,
  norm_safety: float | None = None,
  eps: float = 1e-7,
  adam_b1: float = 0.9,
  adam_b2: float = 0.95,
  adam_eps: float = 1e-8,
  adam_weight_decay: float | None = None,
  grad_clip_norm: float | None = None,
  pe_safety: str = "reference",
) -> optax.GradientTransformation:
  """StepFun Muon for Muon leaves + AdamW (0.9, 0.95, 1e-8) for the rest, one LR (float or optax schedule).

  Leaves are assigned by dims_fn(params) (default `muon_dims`: MuonDims -> Muon, None -> AdamW). Both parts use
  decoupled weight decay p *= 1 - lr * wd (adam_weight_decay None = weight_decay). method "polar_express"
  (ns_steps default 6) or "newton_schulz" (default 5); ortho_dtype "float16" | "float32" | "bfloat16".
  grad_clip_norm: if set, clip by global norm first (StepFun's recipe: 1.0, docs/training.md §1; default off, the
  trainer may clip).
  pe_safety: which Polar Express steps the safety factor divides, "reference" (default) or "last_step_unscaled"
  (`polar_express_coeffs`).
  State: a pytree of arrays (optax PartitionState; Muon momentum fp32, AdamW moments fp32).
  """
  _coeffs(method, ns_steps, pe_safety)
  _dtype(ortho_dtype)
  ortho_kwargs = dict(
    method=method, ns_steps=ns_steps, ortho_dtype=ortho_dtype, norm_safety=norm_safety, eps=eps, pe_safety=pe_safety
  )
  labels = lambda tree: jax.tree.map(lambda d: "adamw" if d is None else "muon", dims_fn(tree), is_leaf=_is_dims)
  tx = optax.partition(
    {
      "muon": scale_by_stepfun_muon(
        learning_rate,
        dims_fn=dims_fn,
        beta=beta,
        nesterov=nesterov,
        weight_decay=weight_decay,
        rms_scale=rms_scale,
        **ortho_kwargs,
      ),
      "adamw": _adamw_fp32(
        learning_rate, adam_b1, adam_b2, adam_eps, weight_decay if adam_weight_decay is None else adam_weight_decay
      ),
    },
    labels,
  )
  if grad_clip_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)
  return tx
