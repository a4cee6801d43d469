"""FP8 products: ``jax_tma.quantize_fp8`` (quantize.py), ``fp8_matmul`` and ``fp8_dot_general``
(api.py) on the sm90 FP8 kernel."""
