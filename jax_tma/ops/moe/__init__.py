"""Mixture-of-Experts MLP: ``jax_tma.moe_mlp`` (api.py), routing, dispatch and combine around
the grouped kernels of ``ragged``; the function behind ``jax_tma.flax.MoE``."""
