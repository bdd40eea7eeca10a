"""Type tests for the values a user passes (config fields, keyword arguments, parsed JSON), used by every check
that names a bad value. Python's bool is an int, but a user's True is not a size: neither test accepts a bool.
numpy scalars count (a config may hold them); jax arrays do not."""

import numbers

import numpy as np


def is_int(v) -> bool:
  """An integer (Python or numpy), not a bool."""
  return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def is_number(v) -> bool:
  """A real number (int, float, numpy scalar; NaN included: compare it to a bound), not a bool."""
  return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
