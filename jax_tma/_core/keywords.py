"""The keywords the ops share with lax, and their older spellings."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def preferred_type(op: str, preferred_element_type: Any, out_dtype: Any) -> Any:
    """lax's ``preferred_element_type`` or its alias ``out_dtype``, whichever is given (None
    where neither is); a ValueError naming `op` where both are given and differ."""
    if out_dtype is None:
        return preferred_element_type
    if (preferred_element_type is not None
            and jnp.dtype(out_dtype) != jnp.dtype(preferred_element_type)):
        raise ValueError(
            f"{op}: out_dtype is another name for preferred_element_type; got "
            f"out_dtype={out_dtype!r} and preferred_element_type={preferred_element_type!r}")
    return out_dtype
