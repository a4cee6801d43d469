"""FP8 products: ``jax_tma.quantize_fp8`` (quantize.py), ``fp8_matmul`` and ``fp8_dot_general``
(api.py) on the sm90 FP8 kernel, and the block-scaled grouped product ``fp8_ragged_dot``
(ragged.py, ragged_primitive.py) on its grouped (ragged rows) form."""
