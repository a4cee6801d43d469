"""The ops, one package each, every one built alike on jax_tma/_core: ``gemm`` (dot_general,
matmul, autotune), ``ragged`` (ragged_dot), ``dense`` (dense layers and MLP blocks with fused
epilogues), ``fp8`` (quantize_fp8, FP8 products). In each, where the concept exists:
``api.py`` the public functions, ``primitive.py`` the primitive with its lowering and rules,
``sharding.py`` its custom_partitioning rules, ``config.py`` its tile configurations and the
heuristic that picks one. Ops import each other's public functions only (dense and fp8
differentiate through ``gemm.api.dot_general``)."""
