"""Grouped GEMM for Mixture-of-Experts: ``jax_tma.ragged_dot``, ``ragged_dot_general`` (api.py)
on the sm90 ragged kernel."""
