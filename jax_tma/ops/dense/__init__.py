"""Dense layers and MLP blocks with fused epilogues: ``jax_tma.dense``, ``gated_dense``, ``mlp``,
``gated_mlp`` (api.py) on the sm90 GEMM kernel with the elementwise work in its epilogue."""
