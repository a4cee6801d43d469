"""The GEMM benchmarks' shape sets: the default and batched suites (with their --quick and
--dry-run forms), the dense projections of public LLMs at prefill and decode token counts, and
random shapes drawn from a seed. Pure Python and numpy, so that every script (and the tests)
draws the same shapes without importing jax."""

from __future__ import annotations

import math

import numpy as np

SUITE = [
    # square
    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
    (16384, 16384, 16384),
    # 16384 tokens through 8B-class projections
    (16384, 6144, 4096), (16384, 4096, 4096), (16384, 28672, 4096), (16384, 4096, 14336),
    # 8192 tokens through 70B-class projections
    (8192, 10240, 8192), (8192, 57344, 8192), (8192, 8192, 28672),
    # decode-like
    (1, 4096, 4096), (16, 6144, 4096), (64, 28672, 4096), (128, 4096, 14336),
    # odd
    (3000, 5000, 2048), (1000, 1000, 1000), (4095, 4097, 4096), (512, 512, 65536),
]
QUICK = [(4096, 4096, 4096), (8192, 8192, 8192), (16, 6144, 4096), (512, 512, 65536),
         (4095, 4097, 4096)]
DRY_RUN = [(64, 64, 64), (7, 129, 72)]
# (B, M, N, K): attention-like products over heads (scores [S,D] @ [D,S], then weights [S,S] @
# values [S,D]) and a few experts of a mixture-of-experts layer.
BATCHED_SUITE = [
    (32, 2048, 2048, 128), (32, 2048, 128, 2048),
    (8, 4096, 4096, 128), (8, 4096, 128, 4096),
    (64, 1024, 1024, 64), (64, 1024, 64, 1024),
    (16, 8192, 8192, 128), (16, 8192, 128, 8192),
    (8, 2048, 4096, 4096), (8, 512, 14336, 4096),
]
BATCHED_QUICK = [(32, 2048, 2048, 128), (32, 2048, 128, 2048), (8, 2048, 4096, 4096)]
BATCHED_DRY_RUN = [(2, 64, 64, 64), (3, 7, 129, 72)]
# The dense projections of public models: (family, projection, N = out features, K = in features,
# share of the tokens the product sees). Attention heads are 128 wide; QKV fuses q, k and v;
# gate_up fuses gate and up (2 × intermediate).
LLM_PROJECTIONS = (
    # Llama 3 8B: hidden 4096, intermediate 14336, 32 q / 8 kv heads
    ("llama3-8b", "qkv", 4096 + 2 * 1024, 4096, 1), ("llama3-8b", "o", 4096, 4096, 1),
    ("llama3-8b", "gate_up", 2 * 14336, 4096, 1), ("llama3-8b", "down", 4096, 14336, 1),
    # Llama 3 70B: hidden 8192, intermediate 28672, 64 q / 8 kv heads
    ("llama3-70b", "qkv", 8192 + 2 * 1024, 8192, 1), ("llama3-70b", "o", 8192, 8192, 1),
    ("llama3-70b", "gate_up", 2 * 28672, 8192, 1), ("llama3-70b", "down", 8192, 28672, 1),
    # Mixtral 8x7B: Llama 3 8B's attention; 8 experts of intermediate 14336, 2 per token
    ("mixtral-8x7b", "qkv", 4096 + 2 * 1024, 4096, 1), ("mixtral-8x7b", "o", 4096, 4096, 1),
    ("mixtral-8x7b", "expert gate_up", 2 * 14336, 4096, 2 / 8),
    ("mixtral-8x7b", "expert down", 4096, 14336, 2 / 8),
    # Qwen2.5 72B: hidden 8192, intermediate 29568, 64 q / 8 kv heads
    ("qwen2.5-72b", "qkv", 8192 + 2 * 1024, 8192, 1), ("qwen2.5-72b", "o", 8192, 8192, 1),
    ("qwen2.5-72b", "gate_up", 2 * 29568, 8192, 1), ("qwen2.5-72b", "down", 8192, 29568, 1),
    # Qwen2.5 7B: hidden 3584, intermediate 18944, 28 q / 4 kv heads
    ("qwen2.5-7b", "qkv", 3584 + 2 * 512, 3584, 1), ("qwen2.5-7b", "o", 3584, 3584, 1),
    ("qwen2.5-7b", "gate_up", 2 * 18944, 3584, 1), ("qwen2.5-7b", "down", 3584, 18944, 1),
    # DeepSeek-V3: hidden 7168; MLA down to a q rank of 1536 and a kv rank of 512 (+ 64 rope
    # dims), q up to 128 heads × 192, o from 128 heads × 128; dense layers' intermediate 18432
    ("deepseek-v3", "q_a", 1536, 7168, 1), ("deepseek-v3", "kv_a", 512 + 64, 7168, 1),
    ("deepseek-v3", "q_b", 128 * 192, 1536, 1), ("deepseek-v3", "o", 7168, 128 * 128, 1),
    ("deepseek-v3", "gate_up", 2 * 18432, 7168, 1), ("deepseek-v3", "down", 7168, 18432, 1),
)
LLM_PREFILL = (4096, 16384)  # tokens
LLM_DECODE = (1, 16, 128)
LLM_DRY_RUN_DIVISOR = 128
RANDOM_MAX_DIM = 32768
RANDOM_DRY_RUN_MAX_DIM = 256
RANDOM_MISALIGNED = 1 / 3  # the chance a drawn shape is misaligned
RANDOM_ALIGN = 64
RANDOM_MAX_BYTES = 6 * 2**30  # bf16 a, b and output of one product
RANDOM_MAX_FLOP = 2**41


def split_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int, int]:
    """(batch dims, M, N, K) of a [B,]M,N,K shape."""
    return shape[:-3], *shape[-3:]


def llm_suite(projections=LLM_PROJECTIONS, prefill=LLM_PREFILL, decode=LLM_DECODE,
              divisor: int = 1) -> dict[tuple[int, int, int], str]:
    """The distinct (M, N, K) products of `projections` at each token count, in the order
    drawn (prefill, then decode), each mapped to a label naming every projection it stands for
    ("llama3-70b/qwen2.5-72b qkv decode"). Token counts and features are divided by `divisor`
    (rounded up), for a dry run."""
    origins: dict[tuple[int, int, int], dict[str, list[str]]] = {}
    for phase, counts in (("prefill", prefill), ("decode", decode)):
        for tokens in counts:
            for family, projection, n, k, share in projections:
                shape = (math.ceil(math.ceil(tokens * share) / divisor), math.ceil(n / divisor),
                         math.ceil(k / divisor))
                families = origins.setdefault(shape, {}).setdefault(f"{projection} {phase}", [])
                if family not in families:
                    families.append(family)
    return {shape: ", ".join(f"{'/'.join(families)} {what}" for what, families in found.items())
            for shape, found in origins.items()}


def random_shapes(count: int, seed: int, max_dim: int = RANDOM_MAX_DIM
                  ) -> tuple[list[tuple[int, int, int]], int]:
    """`count` distinct (M, N, K) shapes drawn from numpy's Generator seeded with `seed`, and how
    many draws were rejected (over RANDOM_MAX_BYTES or RANDOM_MAX_FLOP, or repeated).

    With chance RANDOM_MISALIGNED a shape's sizes are log-uniform integers on [1, max_dim] with at
    least one not a multiple of 8; otherwise they are log-uniform on [RANDOM_ALIGN, max_dim],
    rounded to multiples of RANDOM_ALIGN.
    """
    rng = np.random.default_rng(seed)
    shapes: list[tuple[int, int, int]] = []
    rejected = 0
    while len(shapes) < count:
        misaligned = rng.random() < RANDOM_MISALIGNED
        low = 1 if misaligned else RANDOM_ALIGN
        # floor(exp(U[log low, log(max + 1)))) puts mass log((d + 1) / d) on each integer d
        dims = np.floor(np.exp(rng.uniform(math.log(low), math.log(max_dim + 1), 3)))
        dims = np.minimum(dims.astype(np.int64), max_dim)
        if not misaligned:
            dims = np.maximum(RANDOM_ALIGN, np.round(dims / RANDOM_ALIGN).astype(np.int64)
                              * RANDOM_ALIGN)
        elif np.all(dims % 8 == 0):
            dims[rng.integers(3)] -= 1
        m, n, k = (int(d) for d in dims)
        if (2 * (m * k + k * n + m * n) > RANDOM_MAX_BYTES or 2 * m * n * k > RANDOM_MAX_FLOP
                or (m, n, k) in shapes):
            rejected += 1
            continue
        shapes.append((m, n, k))
    return shapes, rejected
