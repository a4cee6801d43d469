"""The built extension's machine code: the GEMM kernels use the Hopper instructions they claim.

Reads the SASS of jax_tma/_jax_tma*.so and of the test extension (_jax_tma_testing*.so) with
cuobjdump (pip: nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm) and checks every sm90 GEMM
kernel for rank-3 TMA loads (UTMALDG.3D), mbarrier operations (SYNCS), warpgroup MMA (HGMMA)
with the transpose forms of its operand layout and register reallocation (USETMAXREG), and for
the absence of local-memory traffic (spills show up as LDL/STL), and that the primitive test
kernels contain the instruction each of them exists to exercise.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from jax_tma import _ext
from jax_tma._core import tiles
from support import REPO



def _cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one beside the nvcc the build uses (tools/find_nvcc.py), else
    one from pip's nvidia-cuda-cuobjdump (nvidia/cu13/bin for CUDA 13, nvidia/cuda_cuobjdump/bin
    for CUDA 12)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.spec_from_file_location("find_nvcc", REPO / "tools" / "find_nvcc.py")
    find_nvcc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(find_nvcc)
    try:
        nvcc, _ = find_nvcc.find_nvcc()
    except find_nvcc.NvccError:
        nvcc = None
    if nvcc is not None:
        beside = pathlib.Path(os.path.realpath(nvcc)).parent / "cuobjdump"
        if beside.exists():
            return str(beside)
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return None
    for root in nvidia.__path__:
        for candidate in sorted(pathlib.Path(root).glob("*/bin/cuobjdump")):
            return str(candidate)
    return None


def _require(condition: bool, why: str) -> None:
    """Skip, unless JAX_TMA_REQUIRE_EXTENSION=1 (CI sets it) makes the gap a failure."""
    if condition:
        return
    if os.environ.get("JAX_TMA_REQUIRE_EXTENSION") == "1":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def kernels() -> dict[str, str]:
    """SASS text of every function in the extensions (the production one and, where built, the
    test extension with the primitive test kernels), keyed by mangled name."""
    _require(_ext._C is not None, f"extension not built: {_ext.extension_error()}")
    tool = _cuobjdump()
    _require(tool is not None, "cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    libraries = [_ext._C.__file__]
    spec = importlib.util.find_spec("jax_tma._jax_tma_testing")
    if spec is not None:
        libraries.append(spec.origin)
    functions = {}
    for library in libraries:
        sass = subprocess.run(
            [tool, "-sass", library], check=True, capture_output=True, text=True
        ).stdout
        for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
            name, _, body = chunk.partition("\n")
            functions[name.strip()] = body
    return functions


# The sm90 GEMM kernel's problems (csrc/kernels/sm90_gemm_problems.cuh): the dense batched GEMM
# and the two grouped (ragged) products.
PROBLEMS = ("DenseGemm", "RaggedRowsGemm", "RaggedKGemm")


def _fusion(name: str) -> tuple[int, int]:
    """(FusionKind, Activation) of a mangled sm90_gemm_kernel instantiation."""
    found = re.search(r"FusionILNS_10FusionKindE(\d)ELNS_10ActivationE(\d)", name)
    assert found, name
    return int(found.group(1)), int(found.group(2))


def _gemm_kernels(kernels: dict[str, str], problems=PROBLEMS, fused=False) -> dict[str, str]:
    """The 16-bit sm90_gemm_kernel instantiations of `problems`: plain epilogues, or with
    `fused` the fused ones (epilogue/fusion.h). The FP8 ones are _fp8_kernels'."""
    found = {name: body for name, body in kernels.items()
             if "sm90_gemm_kernel" in name and any(p in name for p in problems)
             and "Fp8Mainloop" not in name and (_fusion(name)[0] != 0) == fused}
    assert found, f"no sm90_gemm_kernel of {problems} in the extension: {sorted(kernels)}"
    return found


def test_fused_dense_kernels(kernels):
    """Fused epilogues (jax_tma.dense): per type the registry's dense tiles x 11 fusions + the
    forward gelu-erf on the narrow tiles + the gated gradient (silu, tanh gelu) on the ring tile
    of 128 x 256; forward and gated read B N-major, the gradients K-major; the kernels that may
    read an [M, N] operand load it by TMA (rank 4, like D's stores) and read it back with ldmatrix
    (16-bit) in the consumers' epilogue, or 16 bytes at a time in the epilogue warps' (forward
    fusions and activation gradients but erf-gelu on 128 x 256 tiles, whose shared memory holds
    the ring, and every gated gradient; csrc/epilogue/epilogue_warps.cuh); gated ones multiply two B
    maps' blocks, on 128-row tiles in the epilogue warps too."""
    found = _gemm_kernels(kernels, ("DenseGemm",), fused=True)
    assert len(found) == tiles.kernel_counts()["dense"]
    for name, body in found.items():
        kind, act = _fusion(name)
        block_m, block_n = _tile(name)[:2]
        # (the activation gradient only where the pre-activation's ring fits: 128 x 256)
        epilogue_warps = block_m == 128 and (
            kind in (3, 5) or (act != 3 and (kind == 1 or (kind == 2 and block_n == 256))))
        if kind == 5:
            assert (block_m, block_n) == (128, 256) and act in (2, 4), name
        assert re.search(r"\bHGMMA\b", body) and re.search(r"\bUTMASTG\.4D\b", body), name
        assert _layout(name) == ((0, 0) if kind in (2, 5) else (0, 1)), name
        if kind in (1, 2, 5):
            assert re.search(r"\bUTMALDG\.4D\b", body), f"no aux TMA load in {name}"
            ring = epilogue_warps and block_n == 256
            read = r"\bLDS\.128\b" if ring else r"\bLDSM\b"
            if kind == 5:  # the gated gradient: 8 bytes at a time (its warps' registers)
                read = r"\bLDS\.64\b"
            assert re.search(read, body), f"no {read} in {name}"
        if epilogue_warps:  # the staged block read and rewritten 16 (gated gradient: 8) bytes
            width = "64" if kind == 5 else "128"
            assert re.search(rf"\bLDS\.{width}\b", body), name
            assert re.search(rf"\bSTS\.{width}\b", body), name
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory traffic in {name}"


def test_gemm_kernels_are_sm90a(kernels):
    # (bf16, bf16), (bf16, fp32), (fp16, fp16), (fp16, fp32) x the registry's GEMM tiles
    # (jax_tma.COMPILED_CONFIGS and the direct-store variants) x 4 operand layouts (NN, NT, TN, TT).
    found = _gemm_kernels(kernels, ("DenseGemm",))
    assert len(found) == tiles.kernel_counts()["gemm"]
    assert sorted({_layout(name) for name in found}) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_ragged_kernels_are_sm90a(kernels):
    # 4 type pairs x the registry's ragged tiles (jax_tma.RAGGED_CONFIGS): rows mode NN and NT,
    # contraction TN.
    rows = _gemm_kernels(kernels, ("RaggedRowsGemm",))
    contraction = _gemm_kernels(kernels, ("RaggedKGemm",))
    per_layout = len(tiles.RAGGED_TYPES) * len(tiles.RAGGED_TILES)
    assert len(rows) == 2 * per_layout and len(contraction) == per_layout
    assert sorted({_layout(name) for name in rows}) == [(0, 0), (0, 1)]
    assert {_layout(name) for name in contraction} == {(1, 1)}
    assert any("sm90_ragged_prepare_kernel" in name for name in kernels)


def test_gated_ragged_kernels(kernels):
    """The gated rows mode (jax_tma.gated_ragged_dot): per type the registry's gated ragged
    tiles x 3 activations, B N-major; the per-segment maps acquired (UTMACCTL.IV) by the threads
    that store through them; on 128-row tiles the epilogue warps gate the staged block 16 bytes
    at a time."""
    found = _gemm_kernels(kernels, ("RaggedGatedRowsGemm",), fused=True)
    assert len(found) == tiles.kernel_counts()["ragged_gated"]
    for name, body in found.items():
        kind, act = _fusion(name)
        assert kind == 3 and act in (2, 3, 4), name
        assert _layout(name) == (0, 1), name
        assert re.search(r"\bHGMMA\b", body) and re.search(r"\bUTMASTG\.4D\b", body), name
        assert re.search(r"\bUTMACCTL\.IV\b", body), f"no tensormap acquire in {name}"
        if _tile(name)[0] == 128:
            assert re.search(r"\bLDS\.128\b", body) and re.search(r"\bSTS\.128\b", body), name
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory traffic in {name}"


def test_gated_ragged_grad_kernels(kernels):
    """The gated gradient rows mode (jax_tma.gated_ragged_mlp's backward): per type the
    registry's gated gradient ragged tiles x 2 activations (silu, tanh gelu), w_down K-major;
    the epilogue warps load the two pre-activations (TMA rank 4) through per-segment maps they
    acquire (UTMACCTL.IV), 8 bytes at a time, and store both cotangents."""
    found = _gemm_kernels(kernels, ("RaggedGatedGradRowsGemm",), fused=True)
    assert len(found) == tiles.kernel_counts()["ragged_gated_grad"]
    for name, body in found.items():
        kind, act = _fusion(name)
        assert kind == 5 and act in (2, 4), name
        assert _tile(name)[:2] == (128, 256), name
        assert _layout(name) == (0, 0), name
        assert re.search(r"\bHGMMA\b", body) and re.search(r"\bUTMASTG\.4D\b", body), name
        assert re.search(r"\bUTMALDG\.4D\b", body), f"no pre-activation load in {name}"
        assert re.search(r"\bUTMACCTL\.IV\b", body), f"no tensormap acquire in {name}"
        assert re.search(r"\bLDS\.64\b", body), name
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory traffic in {name}"


@pytest.mark.parametrize(
    "opcode",
    ["UTMALDG.3D", "SYNCS.ARRIVE", "SYNCS.PHASECHK", "HGMMA", "USETMAXREG", "UTMACCTL.PF"],
)
def test_gemm_kernels_use_hopper_instructions(kernels, opcode):
    for name, body in _gemm_kernels(kernels).items():
        assert re.search(rf"\b{re.escape(opcode)}", body), f"{opcode} missing in {name}"


def test_ragged_kernels_acquire_their_tensor_maps(kernels):
    """Maps the prepare kernel wrote are acquired (fence.proxy.tensormap: UTMACCTL.IV) by the
    threads that copy through them: the epilogue (rows mode) or the producer (contraction)."""
    for name, body in _gemm_kernels(kernels, ("RaggedRowsGemm", "RaggedKGemm")).items():
        assert re.search(r"\bUTMACCTL\.IV\b", body), f"no tensormap acquire in {name}"
    for name, body in _gemm_kernels(kernels, ("DenseGemm",)).items():
        assert not re.search(r"\bUTMACCTL\.IV\b", body), name


def _tile(name: str) -> tuple[int, ...]:
    """(block_m, block_n, stages, cluster_m, epilogue) of a mangled TileConfig instantiation."""
    found = re.search(r"TileConfigILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELNS0_12EpilogueKindE(\d)", name)
    assert found, name
    return tuple(int(x) for x in found.groups())


def _layout(name: str) -> tuple[int, int]:
    """(A, B) of a mangled OperandLayout instantiation: 0 K-major, 1 M- or N-major."""
    found = re.search(r"OperandLayoutILNS0_5MajorE(\d)ELS\w*?_(\d)E", name)
    assert found, name
    return int(found.group(1)), int(found.group(2))


def test_gemm_wgmma_transposes_follow_the_layout(kernels):
    """wgmma's transpose immediates are the layout's: .tnspA for M-major A, .tnspB for N-major
    B, on every HGMMA of the kernel."""
    for name, body in _gemm_kernels(kernels).items():
        major_a, major_b = _layout(name)
        hgmma = re.findall(r"\bHGMMA\.[^;]*", body)
        assert hgmma, name
        for line in hgmma:
            assert ("tnspA" in line) == (major_a == 1), f"{line} in {name}"
            assert ("tnspB" in line) == (major_b == 1), f"{line} in {name}"


def test_gemm_loads_are_rank_3(kernels):
    """A and B maps are {inner, outer, batch}: every operand load is a rank-3 copy."""
    for name, body in _gemm_kernels(kernels).items():
        loads = re.findall(r"\bUTMALDG\.(\w+)", body)
        assert loads and set(loads) == {"3D"}, f"{sorted(set(loads))} in {name}"


def test_gemm_epilogues_and_clusters(kernels):
    """TMA-store epilogues stage through stmatrix (16-bit outputs) and store rank-4 boxes
    ({N, M, batch, split}) with UTMASTG; clustered tiles multicast B and signal the peer's
    barriers; no fence per remote arrival."""
    for name, body in _gemm_kernels(kernels).items():
        _, _, _, cluster_m, epilogue = _tile(name)
        if epilogue == 0:
            assert re.search(r"\bUTMASTG\.4D\b", body), f"no rank-4 TMA store in {name}"
            assert not re.search(r"\bUTMASTG\.[1235]D\b", body), name
            if "S2_NS0_10TileConfig" in name:  # output type == input type: 16-bit
                assert re.search(r"\bSTSM\b", body), f"no stmatrix in {name}"
        else:
            assert not re.search(r"\bUTMASTG", body), name
        if cluster_m > 1:
            assert re.search(r"\bUTMALDG\.3D\.MULTICAST\b", body), f"no multicast in {name}"
            assert re.search(r"SYNCS\.ARRIVE\.TRANS64\.RED\b", body), f"no remote arrive in {name}"
            # One cluster barrier at start: a cluster-scope fence per arrival would cost
            # a MEMBAR.ALL.GPU in every pipeline step.
            assert len(re.findall(r"MEMBAR\.ALL\.GPU", body)) <= 1, f"fences in {name}"
        else:
            assert not re.search(r"MULTICAST", body), name


def test_gemm_kernels_do_not_spill(kernels):
    for name, body in _gemm_kernels(kernels).items():
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory traffic in {name}"


@pytest.mark.parametrize(
    "opcode",
    [
        "UTMALDG.1D", "UTMALDG.3D", "UTMALDG.4D", "UTMALDG.5D", "UTMALDG.2D.MULTICAST",
        "UTMASTG.1D", "UTMASTG.2D", "UTMASTG.5D", "UTMAREDG.2D.ADD", "UCGABAR_ARV",
        "UCGABAR_WAIT", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT",
        # remote (cluster) mbarrier arrive: PipelineTmaAsync::consumer_release_cluster
        "SYNCS.ARRIVE.TRANS64.RED",
        # cp.async with zero fill, and its mbarrier arrive (PipelineCpAsync)
        "LDGSTS.E.BYPASS.128.ZFILL", "ARRIVES.LDGSTSBAR.64.ARVCNT",
        # st.async into a peer CTA's shared memory, 4 and 16 bytes
        "STAS", "STAS.128",
        # fence.proxy.tensormap acquire (tensormap.replace itself becomes plain STG stores)
        "UTMACCTL.IV",
        # named barrier arrive (bar.arrive)
        "BAR.ARV",
    ],
)
def test_primitive_test_kernels_use_tma_instructions(kernels, opcode):
    _require(importlib.util.find_spec("jax_tma._jax_tma_testing") is not None,
             "the test extension _jax_tma_testing is not built (JAX_TMA_BUILD_TESTING=0)")
    bodies = [body for name, body in kernels.items() if "testing" in name]
    assert bodies, "no primitive test kernels in the test extension"
    assert any(re.search(rf"\b{re.escape(opcode)}\b", body) for body in bodies), opcode


def _fp8_kernels(kernels: dict[str, str], problem: str = "DenseGemm") -> dict[str, str]:
    """The FP8 instantiations of the sm90 GEMM kernel: the dense products' (contract/sm90_fp8.h)
    or, with problem="RaggedRowsGemm", the grouped ones' (contract/sm90_fp8_ragged_dot.h)."""
    found = {name: body for name, body in kernels.items()
             if "sm90_gemm_kernel" in name and "Fp8Mainloop" in name and problem in name}
    assert found, f"no FP8 sm90_gemm_kernel of {problem} in the extension"
    return found


def _promoted(name: str) -> bool:
    """Whether a mangled FP8 kernel promotes (Fp8Mainloop's kPromote)."""
    found = re.search(r"Fp8MainloopI\w*?Lb([01])E", name)
    assert found, name
    return found.group(1) == "1"


def _check_fp8_body(name: str, body: str, kind: str, part: int) -> None:
    """What every FP8 kernel's SASS holds: QGMMA of its type, `part` columns wide and nothing
    else (no 16-bit HGMMA, no transposed operand), K-major operands, the scaled epilogue, A, B
    and the scales loaded by rank-3 TMA, the output stored by TMA."""
    qgmma = re.findall(r"\bQGMMA\.[^ ;]*", body)
    assert qgmma and set(qgmma) == {f"QGMMA.64x{part}x32.F32.{kind}.{kind}"}, (set(qgmma), name)
    assert not re.search(r"\bHGMMA\b", body) and "tnsp" not in body, name
    assert _layout(name) == (0, 0), name
    assert _fusion(name) == (4, 0), name
    assert set(re.findall(r"\bUTMALDG\.(\w+)", body)) == {"3D"}, name
    assert re.search(r"\bUTMASTG\.4D\b", body), name


def test_fp8_kernels(kernels):
    """FP8 products: the registry's tiles (promoted) and fast tiles x (e4m3, e5m2) x (bf16,
    fp32 out). Every one runs FP8 wgmma (QGMMA) of its type on K-major operands (no
    transposes): promoted kernels one group of the tile's width per K slice (144 included), or
    two of 128 on 256-wide tiles, fast ones one of the tile's width; loads A, B and the scales by
    TMA (rank 3), scales in the epilogue (FusionKind::kScaled), stores by TMA, and never touches
    local memory."""
    found = _fp8_kernels(kernels)
    assert len(found) == tiles.kernel_counts()["fp8"]
    promoted = {n for n in found if _promoted(n)}
    assert len(promoted) == len(tiles.FP8_TILES) * len(tiles.FP8_TYPES) * len(tiles.FP8_OUT_TYPES)
    for name, body in found.items():
        kind = "E5M2" if "e5m2" in name else "E4M3"
        width = _tile(name)[1]
        part = 128 if name in promoted and width == 256 else width
        _check_fp8_body(name, body, kind, part)
        # The register split: consumers 232, producer 40.
        assert set(re.findall(r"\bUSETMAXREG\.(?:TRY_ALLOC|DEALLOC)\S* (?:UP0, )?(0x[0-9a-f]+)",
                              body)) == {"0xe8", "0x28"}, name
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory traffic in {name}"
        if _tile(name)[3] > 1:
            assert re.search(r"\bUTMALDG\.3D\.MULTICAST\b", body), name
        # Promoted kernels multiply each K slice's partial sums by the scales into the
        # accumulators: at least one FFMA per partial-sum register of a group.
        if name in promoted:
            assert len(re.findall(r"\bFFMA\b", body)) >= part // 2, name
    # Tiles up to 128 columns wide keep the next slice's group in flight while promoting
    # (wait_group 1: the overlapped schedule, two sets of partial sums); wider ones of one group
    # (144, 192) retire it first (wait_group 0: the cross schedule).
    narrow = {n: b for n, b in found.items() if n in promoted and _tile(n)[1] <= 128}
    assert {_tile(n)[1] for n in narrow} == {128}
    for name, body in narrow.items():
        assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", body), name
    cross = {n: b for n, b in found.items() if n in promoted and 128 < _tile(n)[1] <= 192}
    assert {_tile(n)[1] for n in cross} == {144, 192}
    for name, body in cross.items():
        assert not re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", body), name
        assert _probes_before_retire(body), name


def _probes_before_retire(body: str) -> bool:
    """Whether a stage-full probe (TRYWAIT into a predicate) is issued before a retire
    (WARPGROUP.DEPBAR) and its predicate first read after it: the cross schedule looks at the
    next stage early and waits for it only after the retire and promotion
    (mainloop/sm90_tma_wgmma_fp8.cuh)."""
    lines = body.splitlines()
    for i, line in enumerate(lines):
        probe = re.search(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT (P\d),", line)
        if not probe:
            continue
        read = re.compile(rf"@!?{probe.group(1)}\b|\b{probe.group(1)}\b.*\bBRA\b")
        for later in lines[i + 1:]:
            if re.search(r"WARPGROUP\.DEPBAR\.LE", later):
                return True
            if read.search(later):
                break
    return False


def test_fp8_ragged_kernels(kernels):
    """FP8 grouped products (jax_tma.fp8_ragged_dot): the registry's FP8 ragged tiles x (bf16,
    fp32 out), e4m3, promoted: e4m3 wgmma (QGMMA) on K-major operands, A, B and the scales loaded
    by TMA (rank 3), the per-segment output maps acquired (UTMACCTL.IV) by the threads that store
    through them, the scaled epilogue, at least one FFMA per partial-sum register of a group (the
    promotion), no local memory."""
    found = _fp8_kernels(kernels, "RaggedRowsGemm")
    assert len(found) == tiles.kernel_counts()["fp8_ragged"]
    assert {_tile(n)[:4] for n in found} == {e.tile.key for e in tiles.FP8_RAGGED_TILES}
    for name, body in found.items():
        assert _promoted(name), name
        width = _tile(name)[1]
        part = 128 if width == 256 else width
        _check_fp8_body(name, body, "E4M3", part)
        assert re.search(r"\bUTMACCTL\.IV\b", body), f"no tensormap acquire in {name}"
        assert len(re.findall(r"\bFFMA\b", body)) >= part // 2, name
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory traffic in {name}"
        if 128 < width <= 192:
            assert _probes_before_retire(body), name
