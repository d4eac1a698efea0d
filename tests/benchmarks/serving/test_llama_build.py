"""The llama-server that scripts/build_llama_server.sh builds is portable: no AMX tile instructions and no AVX-512
code (the cached binary must run on the AVX2-only machines too, where either dies with SIGILL), and its SOURCE
file (the cache key) records the portable build flags."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.serving import serving

AMX = ("tilezero", "tileloadd", "tileloaddt1", "tilestored", "ldtilecfg", "sttilecfg", "tilerelease",
       "tdpbssd", "tdpbsud", "tdpbusd", "tdpbuud", "tdpbf16ps", "tdpfp16ps")  # fmt: skip
AVX512_MASK_OPS = ("kmov[bwdq]", "kand[bwdq]", "kandn[bwdq]", "kor[bwdq]", "kxor[bwdq]", "kxnor[bwdq]",
                   "knot[bwdq]", "kortest[bwdq]", "ktest[bwdq]", "kshift[lr][bwdq]", "kunpck(bw|wd|dq)", "kadd[bwdq]")  # fmt: skip
VNNI_BF16 = ("vpdpbusds?", "vpdpwssds?", "vdpbf16ps", "vcvtne2ps2bf16")  # AVX-VNNI / AVX512-VNNI / AVX512-BF16
# AT&T syntax as objdump prints it: the mnemonic after a tab; zmm, xmm16-31/ymm16-31 (EVEX only), mask and tile registers
FORBIDDEN = "|".join([
    "\t(" + "|".join(AMX + AVX512_MASK_OPS + VNNI_BF16) + r")\b",  # a real tab: grep -E has no \t
    r"%zmm[0-9]+", r"%[xy]mm(1[6-9]|2[0-9]|3[01])\b", r"%k[0-7]\b", r"%tmm[0-7]\b",
])  # fmt: skip
FUNCTION = r"^[0-9a-f]+ <.*>:$"
PORTABLE_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                  "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
                  "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")  # fmt: skip

needs_binutils = pytest.mark.skipif(not (shutil.which("objdump") and shutil.which("grep")), reason="needs objdump (binutils) and grep")
needs_llama_server = pytest.mark.skipif(
    not serving.SERVER_BINARY.is_file(), reason="llama-server is not built: bash scripts/build_llama_server.sh (~10 min)"
)
on_x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AMX and AVX-512 are x86-64 only")


def forbidden_instructions(binary: Path) -> tuple[Counter[str], dict[str, int]]:
    """(count per forbidden mnemonic or register, count per function holding any), from objdump's disassembly
    streamed through grep, so only the matching lines and the function headers reach Python."""
    objdump = subprocess.Popen(["objdump", "-d", "--no-show-raw-insn", str(binary)], stdout=subprocess.PIPE)
    grep = subprocess.Popen(["grep", "-E", f"{FORBIDDEN}|{FUNCTION}"], stdin=objdump.stdout, stdout=subprocess.PIPE, text=True)
    assert objdump.stdout is not None and grep.stdout is not None
    objdump.stdout.close()  # grep holds it now
    forbidden, function_pattern = re.compile(FORBIDDEN), re.compile(FUNCTION)
    found: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    function = "?"
    for line in grep.stdout:
        if function_pattern.match(line):
            function = line.split("<", 1)[1].rstrip().rstrip(":").rstrip(">")
            continue
        hits = {match.group(0).strip() for match in forbidden.finditer(line)}
        found.update(hits)
        functions[function] += 1
    assert grep.wait(timeout=300) in (0, 1) and objdump.wait(timeout=300) == 0, "objdump or grep failed"
    return found, dict(functions)


@needs_binutils
@on_x86
def test_the_scan_finds_amx_and_avx512_in_a_compiled_object(tmp_path):
    """The patterns match objdump's real output: an object built with AMX and AVX-512 intrinsics is caught."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    source = tmp_path / "amx.c"
    source.write_text(
        "#include <immintrin.h>\n"
        "void tiles(void) { _tile_zero(0); _tile_release(); }\n"
        "__m512 wide(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }\n"
        "__mmask16 mask(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, 1); }\n"
        "int narrow(int x) { return x + 1; }\n"
    )
    built = subprocess.run([compiler, "-O2", "-mamx-tile", "-mavx512f", "-c", str(source), "-o", str(tmp_path / "amx.o")],
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode != 0:
        pytest.skip(f"the compiler has no AMX/AVX-512 support: {built.stderr.strip()[:200]}")
    found, functions = forbidden_instructions(tmp_path / "amx.o")
    assert {"tilezero", "tilerelease", "%tmm0"} <= set(found)
    assert any(name.startswith("%zmm") for name in found) and any(name.startswith("%k") for name in found)
    assert set(functions) == {"tiles", "wide", "mask"}  # nothing in the plain function


@needs_binutils
@on_x86
@needs_llama_server
def test_the_built_llama_server_has_no_amx_and_no_avx512_code():
    found, functions = forbidden_instructions(serving.SERVER_BINARY)
    worst = sorted(functions.items(), key=lambda item: -item[1])[:10]
    assert not found, (
        f"{serving.SERVER_BINARY} holds {sum(found.values())} AMX/AVX-512 instructions ({dict(found.most_common(12))}) "
        f"in {len(functions)} functions, e.g. {worst}: it would die with SIGILL where the CPU (or its VM) lacks them; "
        "rebuild with bash scripts/build_llama_server.sh"
    )


@needs_llama_server
def test_the_cache_key_records_the_portable_build_flags():
    source = serving.SERVER_BINARY.parents[1] / "SOURCE"
    assert source.is_file(), f"{source} is missing: the binary predates the flags in the cache key; rebuild it"
    recorded = source.read_text().split()
    assert recorded[:2] == ["llama-cpp-python", "0.3.36"]
    expected = PORTABLE_FLAGS if platform.machine().lower() in ("x86_64", "amd64") else ("-DGGML_NATIVE=OFF",)
    missing = [flag for flag in expected if flag not in recorded]
    assert not missing, f"{source} lacks {missing}: rebuild with bash scripts/build_llama_server.sh"
