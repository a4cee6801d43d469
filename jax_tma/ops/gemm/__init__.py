"""Dense GEMM: ``jax_tma.dot_general``, ``jax_tma.matmul`` (api.py) on the sm90 GEMM kernel, how
a product maps onto the kernel's strided view (plan.py), its configurations and cost model
(config.py), and the autotuner (autotune.py) with the cache entries it leaves (tuned.py)."""
