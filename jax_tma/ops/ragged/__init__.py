"""Grouped GEMM for Mixture-of-Experts: ``jax_tma.ragged_dot``, ``ragged_dot_general`` (api.py)
on the sm90 ragged kernel, and the gated grouped product ``jax_tma.gated_ragged_dot``
(gated.py, gated_primitive.py) on its gated rows mode."""
