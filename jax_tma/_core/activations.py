"""The activations the ops and layers name, as jnp functions: the XLA path of the fused dense
layers, the reference of their kernels' epilogues, and the MoE layer's experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Names a gated product (act(x @ w_gate) * (x @ w_up)) takes; "gelu" is the tanh form.
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "gelu_erf")
# Every name a plain activation takes (None: the identity).
ACTIVATIONS = (None, "relu", *GATED_ACTIVATIONS)


def activate(name: str | None, z):
    """The activation in jnp ("gelu" canonicalised to "gelu_tanh" by the caller)."""
    if name is None:
        return z
    if name == "relu":
        return jnp.maximum(z, 0)
    if name == "gelu_tanh":
        return jax.nn.gelu(z, approximate=True)
    if name == "gelu_erf":
        return jax.nn.gelu(z, approximate=False)
    if name == "silu":
        return jax.nn.silu(z)
    raise ValueError(name)
