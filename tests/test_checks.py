"""stepflash_jax.checks: the type tests every bad-value check uses (a bool is neither an int nor a number)."""

import math

import jax.numpy as jnp
import numpy as np

from stepflash_jax.checks import is_int, is_number


def test_a_bool_is_neither_an_int_nor_a_number():
  for v in (True, False, np.bool_(True)):
    assert not is_int(v) and not is_number(v), v


def test_ints_and_numbers():
  for v in (0, -3, 2**70, np.int32(4), np.uint8(1)):
    assert is_int(v) and is_number(v), v
  for v in (0.5, 2.0, math.nan, math.inf, np.float32(1.5)):
    assert is_number(v) and not is_int(v), v  # 2.0 is not an int: each check says which it needs
  for v in (None, "3", [1], (1, 2), 1j, jnp.int32(3)):
    assert not is_int(v) and not is_number(v), v
