"""Grouped GEMM for Mixture-of-Experts: ``jax_tma.ragged_dot``, ``ragged_dot_general`` (api.py)
on the sm90 ragged kernel, the gated grouped product ``jax_tma.gated_ragged_dot``
(gated.py, gated_primitive.py) on its gated rows mode, and the gated expert MLP
``jax_tma.gated_ragged_mlp`` (gated_mlp.py) whose backward runs the gated gradient rows mode
(gated_grad_primitive.py)."""
