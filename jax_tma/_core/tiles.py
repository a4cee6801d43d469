"""The one table of the kernels' compiled tiles, and every axis that multiplies them into kernels.

Pure data (no jax import): scripts/gen_tiles.py writes the C++ side from it
(csrc/contract/sm90_tiles.generated.h: the TileConfig aliases and the X-macro lists that the
contract headers, csrc/kernels/ instantiation files and csrc/ffi/ dispatchers expand; and the
instantiation files csrc/kernels/sm90_*_<types>.cu themselves), the op configs
(jax_tma/ops/*/config.py) import their tuples from here, and the tests take their kernel counts from
here (tests/kernels/test_ptxas.py, tests/kernels/test_sass.py, tests/tooling/test_tile_registry.py).

Each tile carries a one-line `why`: the shapes, benchmark or heuristic that pick it (evidence:
the heuristic surveys and committed benchmark results summed up in issue 59). Dropped in issue 59,
with what the evidence said:
  GEMM 64 x 256 in pairs (64, 256, 4, 2): no heuristic pick in 4230 (shape, dtype) cases and no
    row in any committed benchmark or autotune result; 64 x 256 alone wins everywhere it would.
  dense 128 x 256 in pairs (128, 256, 3, 2), every fusion and the gated gradient: level with or
    behind 128 x 256 alone on every swept pattern (H100 --sweep), the cost
    model ties the two, and its kernels were the dearest of the build.
"""

from __future__ import annotations

import dataclasses

TMA_STORE, DIRECT = "tma_store", "direct"

# C++ spelling of the element types the tables name.
CXX_TYPES = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float", "e4m3": "__nv_fp8_e4m3",
             "e5m2": "__nv_fp8_e5m2"}


@dataclasses.dataclass(frozen=True)
class Tile:
    """One TileConfig instantiation (csrc/contract/sm90_gemm.h) under its C++ alias."""

    cxx: str  # the alias, e.g. "Tile128x256C2"
    block_m: int
    block_n: int
    stages: int
    cluster_m: int
    epilogue: str = TMA_STORE  # EpilogueKind: kTmaStore or kDirect
    epilogue_buffers: int | None = None  # None: TileConfig's default, a whole warpgroup's block
    element_bytes: int = 2  # 1: FP8 (Fp8Tile)
    note: str = ""  # measurements behind the choice, written above the alias

    @property
    def key(self) -> tuple[int, int, int, int]:
        """(block_m, block_n, stages, cluster_m): the Python configs' and the FFI attrs' tile."""
        return (self.block_m, self.block_n, self.stages, self.cluster_m)

    def cxx_definition(self) -> str:
        """The `using` line of the alias."""
        args = [self.block_m, self.block_n, self.stages, self.cluster_m]
        if self.element_bytes == 1:
            assert self.epilogue == TMA_STORE
            template = "Fp8Tile"
        else:
            template = "TileConfig"
            args.append("EpilogueKind::kTmaStore" if self.epilogue == TMA_STORE
                        else "EpilogueKind::kDirect")
        if self.epilogue_buffers is not None:
            args.append(self.epilogue_buffers)
        return f"using {self.cxx} = {template}<{', '.join(map(str, args))}>;"


@dataclasses.dataclass(frozen=True)
class Entry:
    """A tile as one op compiles it, and the one-line reason it is compiled."""

    tile: Tile
    why: str


# --- The 16-bit tiles (GEMM, ragged, dense) ---------------------------------------------------
T128x256C2 = Tile(
    "Tile128x256C2", 128, 256, 3, 2,
    note="128 x 256 keeps 3 stages so that its whole 64 KB output block fits the staging area: "
         "with 4 stages and half the staging, the second half of every epilogue waits for the "
         "first half's stores, and the 3-stage kernel measured faster on large products "
         "(docs/notebook/2026-11-29-tile-registry-figures.md).")
T128x256 = Tile("Tile128x256", 128, 256, 3, 1)
T128x192C2 = Tile(
    "Tile128x192C2", 128, 192, 4, 2,
    note="128 x 192 exists for the wave count: where 128 x 256 tiles leave the last wave of the "
         "grid part-empty (3000 x 5000: 3.6 waves), 192-wide ones often fill it (4.9).")
T128x192 = Tile("Tile128x192", 128, 192, 4, 1)
T128x232C2 = Tile(
    "Tile128x232C2", 128, 232, 4, 2, epilogue_buffers=2,
    note="232 columns for the same reason, where neither 192 nor 256 fits the grid: 3000 x 5000 "
         "makes 24 x 22 = 528 tiles, 4 waves of 132 CTAs. B arrives in four whole 64-wide "
         "blocks, and D leaves in 64-column chunks, the last one shifted left to end at column "
         "232 (epilogue/tma_store.cuh). It keeps 4 stages by staging half a warpgroup's block at "
         "a time (a two-batch epilogue), which measured ahead of 128 x 192 pairs and of 3 stages "
         "with one batch on 3000 x 5000 x 2048 (docs/notebook/2026-11-29-tile-registry-figures.md)"
         ".")
T128x128C2 = Tile("Tile128x128C2", 128, 128, 6, 2)
T128x128 = Tile("Tile128x128", 128, 128, 6, 1)
T64x256 = Tile(
    "Tile64x256", 64, 256, 4, 1,
    note="for a few rows against a wide weight (64 x 28672 x 4096), 256 columns make one wave of "
         "112 tiles that stream B. On large products these ping-pong tiles lose to cooperative "
         "128 x 256 ones: the heuristic does not pick them there.")
T64x128C2 = Tile(
    "Tile64x128C2", 64, 128, 8, 2,
    note="operands whose rows are 16-byte but not 32-byte multiples apart (1000 columns of bf16) "
         "halve TMA's load rate; multicasting B halves what each CTA of this tile loads.")
T64x128 = Tile("Tile64x128", 64, 128, 8, 1)
T128x128Direct = Tile("Tile128x128Direct", 128, 128, 6, 1, DIRECT)
T64x128Direct = Tile("Tile64x128Direct", 64, 128, 8, 1, DIRECT)
T64x64 = Tile(
    "Tile64x64", 64, 64, 12, 1,
    note="for decode-like products (a few rows against a wide weight), which stream B: twice the "
         "CTAs of the 64 x 128 tile at the same N, and 12 stages keep 192 KB of loads in flight.")
T64x64Direct = Tile("Tile64x64Direct", 64, 64, 12, 1, DIRECT)

# --- GEMM: every tile x 4 operand layouts x 4 (input, output) type pairs ----------------------
GEMM_TILES = (
    Entry(T128x256C2, "GemmConfig()'s default; large products (2048^2 .. 8192 x 8192 x 28672)"),
    Entry(T128x256, "the stream-K tile of large products (8192^3, 16384 x 6144 x 4096)"),
    Entry(T128x192C2, "wave count of large products (4096 x 4608 x 3584); autotune up to 1.38x"),
    Entry(T128x192, "wave count alone, with stream-K (128 x 24576 x 1536)"),
    Entry(T128x232C2, "wave count where neither 192 nor 256 fits (3000 x 5000 x 2048)"),
    Entry(T128x128C2, "narrow N and batched products (32 x 2048 x 128 x 2048)"),
    Entry(T128x128, "medium products, split-K and stream-K (512 x 512 x 65536)"),
    Entry(T64x256, "a few rows against a wide weight (64 x 28672 x 4096, decode)"),
    Entry(T64x128C2, "misaligned rows (1000^3): pairs halve each CTA's B loads"),
    Entry(T64x128, "small and decode products, split-K (1024^3)"),
    Entry(T128x128Direct, "output rows not 16-byte multiples, medium and large (4095 x 4097)"),
    Entry(T64x128Direct, "output rows not 16-byte multiples, small products (1657 x 1723)"),
    Entry(T64x64, "decode-like products streaming B, the most picked (1 x 4096 x 4096)"),
    Entry(T64x64Direct, "decode-like products with misaligned output rows"),
)
GEMM_LAYOUTS = ("LayoutNN", "LayoutNT", "LayoutTN", "LayoutTT")
GEMM_TYPES = (("bf16", "bf16"), ("bf16", "f32"), ("f16", "f16"), ("f16", "f32"))

# --- ragged: every tile x (layout, mode) x 4 type pairs --------------------------------------
RAGGED_TILES = (
    Entry(T128x256C2, "large groups: 9 of 10 bench_ragged_dot cases, most MoE shapes"),
    Entry(T128x192C2, "wave count, as the dense GEMM's (random shapes)"),
    Entry(T128x128, "N spanning few 256-wide tiles (the N = 1408 sweep's winner)"),
    Entry(T64x256, "many small groups (4096 x 4096 x 1536, G = 128)"),
    Entry(T64x128, "small groups and narrow N"),
)
# The rows mode reads rhs N- or K-major; the contraction mode reads lhs M-major and dy N-major.
RAGGED_LAYOUTS = (("LayoutNN", "RaggedMode::kRows"), ("LayoutNT", "RaggedMode::kRows"),
                  ("LayoutTN", "RaggedMode::kContraction"))
RAGGED_TYPES = GEMM_TYPES

# --- gated ragged (gated_ragged_dot): ragged rows mode with the gated epilogue ----------------
# Output type = input type, weights [G, K, F] N-major (LayoutNN); one file per input type.
RAGGED_GATED_TILES = (
    Entry(T128x256, "large groups and wide F: 128 outputs a tile, as dense gated's large tile"),
    Entry(T128x128, "groups of one or a few row blocks: ragged and dense gated both compile it"),
    Entry(T64x128, "small groups and few rows (ping-pong, as ragged_dot's 64 x 128)"),
)
RAGGED_GATED_NOTE = (
    "only tiles that the gated dense fusion compiles already, without clusters: 128 x 256 "
    "pairs (ragged's large tile) were never compiled with the paired-B mainloop.")
RAGGED_GATED_FUSIONS = ("GatedSilu", "GatedGeluTanh", "GatedGeluErf")
RAGGED_GATED_TYPES = ("bf16", "f16")

# --- gated ragged gradient (gated_ragged_mlp's backward): ragged rows mode, gated gradient ------
# dh = dy @ w_down^T per group (w_down [G, F, D] read K-major: LayoutNT), finished into the gate's
# and the up's cotangents by the epilogue warps; output type = input type, one file per type.
RAGGED_GATED_GRAD_TILES = (
    Entry(T128x256, "every gated MoE backward: the dense gated gradient's ring tile"),
)
RAGGED_GATED_GRAD_NOTE = (
    "the gated gradient needs the epilogue warps' ring for its two pre-activations, which only "
    "the 128 x 256 tile's shared memory holds beside its stages (as the dense gated gradient); "
    "not the exact GELU (its erff spilled in the warps' registers there): XLA computes that "
    "backward.")
RAGGED_GATED_GRAD_FUSIONS = ("GatedGradSilu", "GatedGradGeluTanh")
RAGGED_GATED_GRAD_TYPES = ("bf16", "f16")

# --- dense (fused epilogues): output type = input type ---------------------------------------
DENSE_TILES = (
    Entry(T128x256, "large fused products, with stream-K (bench_epilogues, bench_mlp_block)"),
    Entry(T128x128, "narrow N, with stream-K"),
    Entry(T64x128, "decode rows (M = 16, 64: the weight-read floor benchmarks)"),
)
DENSE_TILES_NOTE = (
    "64 x 256 ping-pong tiles, which hide one consumer's epilogue under the other's mainloop, "
    "ran every fused pattern slower than 128 x 256 on the large products, more so in cluster "
    "pairs (bench_epilogues.py --sweep, docs/ragged-and-epilogues.md), and 128 x 256 pairs "
    "level with or behind 128 x 256 alone: neither is compiled here.")
# The forward GELU with erf, on the tiles it does not spill on.
DENSE_NARROW_TILES = (
    Entry(T128x128, "erf GELU forward: 128 x 256 spills (erff beside 128 accumulators)"),
    Entry(T64x128, "erf GELU forward, few rows"),
)
DENSE_NARROW_NOTE = (
    "the forward gelu with erf spills on 128 x 256 tiles (erff's registers on top of 128 "
    "accumulators): it is compiled on the narrower tiles only.")
# The gated gradient, on the tiles whose shared memory holds the epilogue warps' ring.
DENSE_RING_TILES = (
    Entry(T128x256, "gated gradient (swiglu_grad from 512 rows): the ring holds G and U"),
)
DENSE_RING_NOTE = (
    "the gated gradient is finished by the epilogue warps only, which read its two "
    "pre-activations through their ring: compiled on the tiles whose shared memory holds one. "
    "Not with the exact GELU, whose erff spilled 24-56 bytes a thread in the warps' 56 "
    "registers there.")


@dataclasses.dataclass(frozen=True)
class DenseFusion:
    """One fused epilogue (csrc/epilogue/fusion.h) as the dense op compiles it."""

    cxx: str  # the Fusion alias of csrc/contract/sm90_dense.h
    layout: str
    group: str  # forward, gradient or gated: one instantiation file per group and type
    tiles: str  # "dense", "narrow" or "ring": which tile list it is compiled on


DENSE_FUSIONS = (
    DenseFusion("FuseNone", "LayoutNN", "forward", "dense"),
    DenseFusion("FuseRelu", "LayoutNN", "forward", "dense"),
    DenseFusion("FuseGeluTanh", "LayoutNN", "forward", "dense"),
    DenseFusion("FuseSilu", "LayoutNN", "forward", "dense"),
    DenseFusion("FuseGeluErf", "LayoutNN", "forward", "narrow"),
    DenseFusion("GradRelu", "LayoutNT", "gradient", "dense"),
    DenseFusion("GradGeluTanh", "LayoutNT", "gradient", "dense"),
    DenseFusion("GradGeluErf", "LayoutNT", "gradient", "dense"),
    DenseFusion("GradSilu", "LayoutNT", "gradient", "dense"),
    DenseFusion("GatedSilu", "LayoutNN", "gated", "dense"),
    DenseFusion("GatedGeluTanh", "LayoutNN", "gated", "dense"),
    DenseFusion("GatedGeluErf", "LayoutNN", "gated", "dense"),
    DenseFusion("GatedGradSilu", "LayoutNT", "gated", "ring"),
    DenseFusion("GatedGradGeluTanh", "LayoutNT", "gated", "ring"),
)
DENSE_GROUPS = ("forward", "gradient", "gated")
DENSE_TILE_LISTS = {"dense": DENSE_TILES, "narrow": DENSE_NARROW_TILES,
                    "ring": DENSE_RING_TILES}
DENSE_TYPES = ("bf16", "f16")

# --- FP8: every tile x 2 operand types x 2 output types, promoted and fast ---------------------
F128x256C2 = Tile("Fp8Tile128x256C2", 128, 256, 3, 2, element_bytes=1)
F128x256 = Tile("Fp8Tile128x256", 128, 256, 3, 1, element_bytes=1)
F128x192C2 = Tile("Fp8Tile128x192C2", 128, 192, 4, 2, element_bytes=1)
F128x192 = Tile("Fp8Tile128x192", 128, 192, 4, 1, element_bytes=1)
F128x144C2 = Tile(
    "Fp8Tile128x144C2", 128, 144, 6, 2, epilogue_buffers=1, element_bytes=1,
    note="cuBLAS's promoting FP8 kernel (precision=HIGHEST) on an H200 has this geometry: 1 x 2 "
         "cluster, one 64 x 144 group per consumer warpgroup and slice, 6 stages. B arrives in "
         "three blocks of 48 rows, and one staging chunk (fp32 blocks are 4.5 chunks wide; the "
         "epilogue stores whole batches) leaves room for 6 stages.")
F128x128C2 = Tile("Fp8Tile128x128C2", 128, 128, 5, 2, element_bytes=1)
F128x128 = Tile("Fp8Tile128x128", 128, 128, 5, 1, element_bytes=1)
F64x128 = Tile("Fp8Tile64x128", 64, 128, 7, 1, element_bytes=1)
FP8_TILES = (
    Entry(F128x256C2, "two 128-wide parts per slice; the fast (precision=DEFAULT) geometry"),
    Entry(F128x256, "wide N at few rows (64 x 28672 x 4096)"),
    Entry(F128x192C2, "large products: one 192-wide group per slice (cross schedule)"),
    Entry(F128x192, "the same without a cluster, so with stream-K: products whose 128 x 192 tiles "
                    "leave the last wave part-empty (4096^3: 5.3 waves); not yet measured"),
    Entry(F128x144C2, "cuBLAS's promoting geometry, cross schedule"),
    Entry(F128x128C2, "medium products"),
    Entry(F128x128, "few rows, medium N (256 x 7168 x 2048)"),
    Entry(F64x128, "small and decode products (128 x 7168 x 16384)"),
)
FP8_TILES_NOTE = (
    "the stage counts are the most that fit 227 KB beside a whole block's output staging (128 x "
    "144: beside one chunk of it, as its fp32 block is not whole chunks, and with B in blocks of "
    "48 rows). Promotion "
    "(mainloop/sm90_tma_wgmma_fp8.cuh): tiles up to 128 wide keep two sets of partial sums "
    "(overlapped); 144 and 192 one group per slice, retired before it is promoted while the other "
    "warpgroup's group runs (cross); 256 two parts of 128 (64 registers of partial sums beside "
    "128 promoted ones); 64-row tiles are ping-pong. A 144- or 192-wide tile spans two of B's "
    "scale blocks. Dropped after one sweep on an H200: 64 x 256 (never the fastest), 128 x 112 "
    "and 128 x 176 pairs (wave count; slower than 128 x 128 and 128 x 192 where they fit the grid "
    "better, and a 176-wide tile spans three of B's scale blocks).")
# Fast accumulation (precision=DEFAULT, per-tensor / row / column scales): the whole K range
# in the tensor core, one group of the tile's width per slice.
FP8_FAST_TILES = (
    Entry(F128x256C2, "large products: the 16-bit kernel's geometry"),
    Entry(F128x192C2, "N = 2112 (11 x 192 columns, 4096 x 2112 x 7168): ahead of 128 x 128"),
    Entry(F128x128, "few rows and small products"),
)
FP8_TYPES = ("e4m3", "e5m2")
FP8_OUT_TYPES = ("bf16", "f32")

# --- FP8 ragged (fp8_ragged_dot): ragged rows mode with the FP8 mainloop, promoted -------------
# Block-scaled e4m3 rows [M, K] times K-major weights [G, N, K]; one file, both output types.
FP8_RAGGED_TILES = (
    Entry(F128x256C2, "large groups: two 128-wide parts per slice"),
    Entry(F128x192C2, "large groups, cross schedule (ahead at 32768 rows, G = 4)"),
    Entry(F64x128, "small groups and few rows (ping-pong, as the dense FP8 decode tile)"),
)
FP8_RAGGED_NOTE = (
    "tiles the dense FP8 product compiles already, so the promotion schedules and register "
    "splits are the measured ones; e5m2 operands run XLA's reference (not compiled: each kernel "
    "costs CI a minute of nvcc on 2 cores).")
FP8_RAGGED_TYPES = ("e4m3",)
FP8_RAGGED_OUT_TYPES = ("bf16", "f32")


# --- Derived: the Python tuples ----------------------------------------------------------------
def gemm_tiles() -> tuple[tuple[int, int, int, int, bool], ...]:
    """(block_m, block_n, stages, cluster_m, has a direct-store variant) per TMA-store GEMM tile,
    in table order (jax_tma/ops/gemm/config.py's _COMPILED_TILES)."""
    direct = {e.tile.key for e in GEMM_TILES if e.tile.epilogue == DIRECT}
    return tuple(e.tile.key + (e.tile.key in direct,) for e in GEMM_TILES
                 if e.tile.epilogue == TMA_STORE)


def keys(entries: tuple[Entry, ...]) -> tuple[tuple[int, int, int, int], ...]:
    """The (block_m, block_n, stages, cluster_m) of each entry."""
    return tuple(e.tile.key for e in entries)


# --- Derived: the instantiation files and their kernel counts ---------------------------------
@dataclasses.dataclass(frozen=True)
class TranslationUnit:
    """One generated instantiation file of csrc/kernels/ and the kernels it compiles."""

    name: str  # file name under csrc/kernels/
    op: str  # gemm, ragged, ragged_gated, ragged_gated_grad, dense, fp8 or fp8_ragged
    types: tuple[str, ...]  # (input, output), or (input,) for dense, gated and FP8 ragged
    group: str = ""  # dense: forward, gradient or gated
    kernels: int = 0


def dense_group_kernels(group: str) -> int:
    """Kernels of one dense group for one type."""
    return sum(len(DENSE_TILE_LISTS[f.tiles]) for f in DENSE_FUSIONS if f.group == group)


def translation_units() -> tuple[TranslationUnit, ...]:
    """Every generated instantiation file, the most expensive kind first (the build's order)."""
    units = []
    for a, b in GEMM_TYPES:
        units.append(TranslationUnit(f"sm90_gemm_{a}_{b}.cu", "gemm", (a, b),
                                     kernels=len(GEMM_TILES) * len(GEMM_LAYOUTS)))
    for group in DENSE_GROUPS:
        for t in DENSE_TYPES:
            units.append(TranslationUnit(f"sm90_dense_{t}_{group}.cu", "dense", (t,), group,
                                         dense_group_kernels(group)))
    for t in FP8_TYPES:
        for out in FP8_OUT_TYPES:
            units.append(TranslationUnit(f"sm90_fp8_{t}_{out}.cu", "fp8", (t, out),
                                         kernels=len(FP8_TILES) + len(FP8_FAST_TILES)))
    for t in FP8_RAGGED_TYPES:
        units.append(TranslationUnit(f"sm90_fp8_ragged_dot_{t}.cu", "fp8_ragged", (t,),
                                     kernels=len(FP8_RAGGED_TILES) * len(FP8_RAGGED_OUT_TYPES)))
    for a, b in RAGGED_TYPES:
        units.append(TranslationUnit(f"sm90_ragged_dot_{a}_{b}.cu", "ragged", (a, b),
                                     kernels=len(RAGGED_TILES) * len(RAGGED_LAYOUTS)))
    for t in RAGGED_GATED_TYPES:
        units.append(TranslationUnit(f"sm90_ragged_gated_{t}.cu", "ragged_gated", (t,),
                                     kernels=len(RAGGED_GATED_TILES) * len(RAGGED_GATED_FUSIONS)))
    for t in RAGGED_GATED_GRAD_TYPES:
        units.append(TranslationUnit(
            f"sm90_ragged_gated_grad_{t}.cu", "ragged_gated_grad", (t,),
            kernels=len(RAGGED_GATED_GRAD_TILES) * len(RAGGED_GATED_GRAD_FUSIONS)))
    return tuple(units)


# Hand-written kernel files beside the generated ones, and their entry functions.
OTHER_KERNEL_FILES = {"sm90_ragged_prepare.cu": 1, "sm90_fp8_quantize.cu": 6}


def expected_entries() -> dict[str, int]:
    """ptxas entry functions per file of csrc/kernels/ (tests/kernels/test_ptxas.py)."""
    found = {u.name: u.kernels for u in translation_units()}
    found.update(OTHER_KERNEL_FILES)
    return found


def kernel_counts() -> dict[str, int]:
    """Kernels per op over every type: gemm, ragged, ragged_gated, ragged_gated_grad, dense
    (fused), fp8 (promoted and fast) and fp8_ragged."""
    counts = dict.fromkeys(("gemm", "ragged", "ragged_gated", "ragged_gated_grad", "dense", "fp8",
                            "fp8_ragged"), 0)
    for u in translation_units():
        counts[u.op] += u.kernels
    return counts
