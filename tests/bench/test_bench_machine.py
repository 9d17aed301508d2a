"""Peers and records follow the machine: /proc/cpuinfo → the bench record's ``machine`` and the
llama.cpp build's cmake flags, for an AVX2-only Zen 3, an AVX-512 Zen 4 and a Xeon listing AMX;
each target's compute path from GET /v1/models (an in-process fake server), and the report."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tripod.bench.client import Target, served_models
from tripod.bench.machine import ISA_FLAGS, describe, isa_level, parse_cpuinfo, summary
from tripod.bench.main import record_served
from tripod.bench.report import served_text, write_html

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
_spec = importlib.util.spec_from_file_location("llamacpp_isa", PEERS / "llamacpp_isa.py")
assert _spec is not None and _spec.loader is not None
llamacpp_isa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llamacpp_isa)

_X86 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
        "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 "
        "pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch "
        "fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec "
        "xgetbv1 arat umip vaes vpclmulqdq rdpid fsrm")
_AVX512 = "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 gfni avx512_vnni " \
          "avx512_bitalg avx512_vpopcntdq"
ZEN3_FLAGS = f"{_X86} mmxext fxsr_opt cmp_legacy cr8_legacy sse4a misalignsse topoext clzero xsaveerptr"
ZEN4_FLAGS = f"{ZEN3_FLAGS} {_AVX512} avx512_bf16"
XEON_FLAGS = f"{_X86} {_AVX512} avx_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 movdiri movdir64b"


def cpuinfo(vendor: str, family: int, model: int, stepping: int, name: str, flags: str, cpus: int = 2) -> str:
    """/proc/cpuinfo as Linux writes it: one block per logical CPU, tab-padded keys."""
    block = (f"processor\t: {{i}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
             f"model name\t: {name}\nstepping\t: {stepping}\nmicrocode\t: 0xffffffff\ncpu MHz\t\t: 2449.998\n"
             f"flags\t\t: {flags}\nbogomips\t: 4899.99\n")
    return "\n".join(block.format(i=i) for i in range(cpus))


ZEN3 = cpuinfo("AuthenticAMD", 25, 1, 0, "AMD EPYC 7B13", ZEN3_FLAGS)
ZEN4 = cpuinfo("AuthenticAMD", 25, 17, 1, "AMD EPYC 9B14", ZEN4_FLAGS)
XEON = cpuinfo("GenuineIntel", 6, 143, 8, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", XEON_FLAGS)


def _on(isa: dict[str, bool]) -> set[str]:
    return {f for f, has in isa.items() if has}


def test_cpuinfo_of_three_machine_kinds() -> None:
    zen3, zen4, xeon = parse_cpuinfo(ZEN3), parse_cpuinfo(ZEN4), parse_cpuinfo(XEON)
    assert (zen3["cpu"], zen3["vendor"], zen3["family"], zen3["model"], zen3["stepping"]) == (
        "AMD EPYC 7B13", "AuthenticAMD", 25, 1, 0)
    assert (zen4["family"], zen4["model"], zen4["stepping"]) == (25, 17, 1)
    assert (xeon["cpu"], xeon["vendor"], xeon["family"], xeon["model"], xeon["stepping"]) == (
        "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "GenuineIntel", 6, 143, 8)
    for info in (zen3, zen4, xeon):
        assert list(info["isa"]) == list(ISA_FLAGS) and all(isinstance(v, bool) for v in info["isa"].values())
    assert _on(zen3["isa"]) == {"avx2", "fma", "f16c"} and zen3["isa_level"] == "avx2"
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    assert _on(zen4["isa"]) == avx512 and zen4["isa_level"] == "avx512_bf16"
    assert _on(xeon["isa"]) == avx512 | {"amx_tile", "amx_bf16", "amx_int8"} and xeon["isa_level"] == "avx512_bf16"


def test_isa_levels() -> None:
    zen4 = set(ZEN4_FLAGS.split())
    assert isa_level(zen4 - {"avx512_bf16"}) == "avx512"  # Ice Lake, Skylake-X
    assert isa_level(zen4 - {"avx512_bf16", "avx512dq"}) == "avx2"  # not the whole AVX-512 set: not a level
    assert isa_level(set(ZEN3_FLAGS.split()) - {"f16c"}) == "baseline"
    assert isa_level({"sse2", "sse4_2"}) == isa_level(set()) == "baseline"
    # Not x86 (no flags line), or no /proc/cpuinfo at all: what can be said, said.
    arm = describe("processor\t: 0\nFeatures\t: fp asimd evtstrm aes\nCPU implementer\t: 0x41\n", cores=4)
    assert arm["isa_level"] == "baseline" and arm["cpu"] and arm["cores"] == 4 and arm["family"] is None


def test_describe_and_its_summary() -> None:
    m = describe(ZEN3, cores=2)
    assert m["cores"] == 2 and m["platform"] and m["python"]
    assert json.loads(json.dumps(m)) == m  # the bench record is JSON
    assert summary(m) == "AMD EPYC 7B13 (AuthenticAMD family 25 model 1 stepping 0), 2 cores, ISA avx2: avx2 fma f16c"
    assert "ISA avx512_bf16: avx2 fma f16c avx512f" in summary(describe(XEON, cores=8))
    assert summary({"cores": 2}) == "unknown CPU, 2 cores"  # a record from before
    here = describe()  # this machine: whatever it is, a whole record
    assert here["isa_level"] in ("avx512_bf16", "avx512", "avx2", "baseline") and here["cores"]


def _features(cpuinfo_text: str) -> dict[str, str]:
    flags = llamacpp_isa.cmake_flags(llamacpp_isa.cpu_flags(cpuinfo_text))
    assert flags[0] == "-DGGML_NATIVE=OFF"  # never native: it would pick up AMX
    return dict(f.removeprefix("-DGGML_").split("=") for f in flags[1:])


def test_llamacpp_flags_follow_the_host() -> None:
    zen3, zen4, xeon = _features(ZEN3), _features(ZEN4), _features(XEON)
    for f in (zen3, zen4, xeon):
        assert f["AMX_TILE"] == f["AMX_INT8"] == f["AMX_BF16"] == "OFF"  # listed on the Xeon: still off
        assert f["AVX"] == f["AVX2"] == f["FMA"] == f["F16C"] == f["SSE42"] == f["BMI2"] == "ON"
    assert zen3["AVX512"] == zen3["AVX512_BF16"] == zen3["AVX512_VNNI"] == zen3["AVX512_VBMI"] == "OFF"
    assert zen4["AVX512"] == zen4["AVX512_BF16"] == zen4["AVX512_VNNI"] == zen4["AVX512_VBMI"] == "ON"
    assert zen4["AVX_VNNI"] == "OFF" and xeon["AVX_VNNI"] == "ON"  # VEX VNNI: only where listed
    assert xeon["AVX512"] == xeon["AVX512_BF16"] == "ON"
    skylake = _features(ZEN4.replace(" avx512_bf16", "").replace(" avx512_vnni", "").replace(" avx512vbmi", ""))
    assert skylake["AVX512"] == "ON" and skylake["AVX512_BF16"] == skylake["AVX512_VNNI"] == "OFF"
    # ggml's AVX512 compiles for F, CD, VL, DQ and BW together: one missing, none named.
    no_cd = _features(ZEN4.replace(" avx512cd", ""))
    assert no_cd["AVX512"] == no_cd["AVX512_BF16"] == "OFF" and no_cd["AVX2"] == "ON"
    baseline = _features(cpuinfo("GenuineIntel", 6, 26, 5, "old", "fpu sse sse2 ssse3 sse4_1 sse4_2"))
    assert baseline["AVX"] == baseline["AVX2"] == baseline["FMA"] == "OFF"  # ggml's defaults would say ON
    # One build folder per ISA: a machine of another kind never reuses a wrong binary.
    levels = [llamacpp_isa.level(llamacpp_isa.cpu_flags(t)) for t in (ZEN3, ZEN4, XEON)]
    assert levels == ["avx2", "avx512_bf16-vbmi-vnni", "avx512_bf16-vbmi-vnni"]


def test_llamacpp_build_record_and_check(tmp_path: Path) -> None:
    """The helper as setup_llamacpp.sh / serve_llamacpp.sh call it (the build itself is not run)."""
    infos = {}
    for name, text in (("zen3", ZEN3), ("zen4", ZEN4), ("xeon", XEON)):
        infos[name] = tmp_path / f"{name}.cpuinfo"
        infos[name].write_text(text)

    def helper(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(PEERS / "llamacpp_isa.py"), *args], capture_output=True,
                              text=True, timeout=60)

    r = helper("--cpuinfo", str(infos["zen3"]), "build-dir")
    assert (r.returncode, r.stdout) == (0, "build-avx2\n"), r.stderr
    r = helper("--cpuinfo", str(infos["zen3"]), "cmake-flags")
    assert "-DGGML_AVX512=OFF" in r.stdout.splitlines() and "-DGGML_AVX2=ON" in r.stdout.splitlines()
    bin_dir = tmp_path / "build-avx512_bf16-vbmi-vnni" / "bin"
    bin_dir.mkdir(parents=True)
    assert helper("--cpuinfo", str(infos["zen4"]), "check", str(bin_dir)).returncode == 1  # no record yet
    used = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_AVX512=ON", "-DLLAMA_CURL=OFF"]
    r = helper("--cpuinfo", str(infos["zen4"]), "record", str(bin_dir), *used)
    assert r.returncode == 0, r.stderr
    rec = json.loads((bin_dir / "llama-server.isa.json").read_text())
    assert rec["isa_level"] == "avx512_bf16-vbmi-vnni" and rec["build_dir"] == "build-avx512_bf16-vbmi-vnni"
    assert rec["cmake_flags"] == used and "-DGGML_AVX512_BF16=ON" in rec["isa_flags"]
    assert rec["machine"]["cpu"] == "AMD EPYC 9B14" and rec["machine"]["isa_level"] == "avx512_bf16"
    assert helper("--cpuinfo", str(infos["zen4"]), "check", str(bin_dir)).returncode == 0
    # The Xeon has the same AVX-512 but VEX VNNI too: not the same build; Zen 3 even less so.
    for other in ("xeon", "zen3"):
        r = helper("--cpuinfo", str(infos[other]), "check", str(bin_dir))
        assert r.returncode == 1 and "built for avx512_bf16-vbmi-vnni" in r.stderr, r.stderr
    assert "-DGGML_AVX512=ON" in helper("--cpuinfo", str(infos["zen3"]), "check", str(bin_dir)).stderr


def test_peer_scripts_parse() -> None:
    for script in sorted(PEERS.glob("*.sh")):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, (script.name, r.stderr)


TRIPOD_CARD = {"id": "SmolLM2-135M-Instruct", "object": "model", "owned_by": "tripod", "dtype": "bfloat16",
               "quantization": None, "weights": "dequantized", "compute": {"backend": "cpu", "isa": "avx2"},
               "max_model_len": 8192}
LLAMACPP_CARD = {"id": "smollm2.gguf", "object": "model", "created": 1, "owned_by": "llamacpp",
                 "meta": {"n_params": 134515008}}


def fake_server(cards: dict[str, list[dict[str, Any]] | None], status: int = 200) -> httpx.MockTransport:
    """Servers in process: GET /v1/models on host H answers ``cards[H]`` (an OpenAI list), or
    ``status``; None: a body that is not JSON; a host not in ``cards`` refuses the connection."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host not in cards:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path != "/v1/models":
            return httpx.Response(404)
        data = cards[request.url.host]
        if data is None:
            return httpx.Response(status, text="<html>not an API</html>")
        return httpx.Response(status, json={"object": "list", "data": data})

    return httpx.MockTransport(handle)


def _served(transport: httpx.MockTransport, target: Target) -> tuple[Any, Any]:
    async def go() -> tuple[Any, Any]:
        async with httpx.AsyncClient(transport=transport) as client:
            return await served_models(client, target)

    return asyncio.run(go())


def test_served_models_keeps_the_compute_path() -> None:
    models, why = _served(fake_server({"tripod": [TRIPOD_CARD]}), Target("http://tripod:8000/", "tripod"))
    assert why is None
    assert models == [{"id": "SmolLM2-135M-Instruct", "compute": {"backend": "cpu", "isa": "avx2"},
                       "dtype": "bfloat16", "weights": "dequantized", "owned_by": "tripod"}]  # quantization: none
    ref = {**TRIPOD_CARD, "quantization": "Q4_1", "compute": {"backend": "reference", "reason": "no AVX2"}}
    models, _ = _served(fake_server({"tripod": [ref]}), Target("http://tripod:8000", "tripod"))
    assert models[0]["quantization"] == "Q4_1" and models[0]["compute"]["backend"] == "reference"
    models, _ = _served(fake_server({"llama": [LLAMACPP_CARD]}), Target("http://llama:8080", "llama.cpp"))
    assert models == [{"id": "smollm2.gguf", "owned_by": "llamacpp"}]  # a peer: what it reports
    assert _served(fake_server({"x": []}, status=401), Target("http://x", "x")) == (None, "http_401")
    assert _served(fake_server({"x": None}), Target("http://x", "x")) == (None, "not a JSON object")
    models, why = _served(fake_server({}), Target("http://down:1", "down"))
    assert models is None and why.startswith("connection")


def test_record_served_and_the_report_show_each_compute_path(tmp_path: Path) -> None:
    targets = [Target("http://tripod:8000", "tripod"), Target("http://llama:8080", "llama.cpp"),
               Target("http://down:1", "gone")]
    entries: list[dict[str, Any]] = [{"base_url": t.base_url, "label": t.label, "model": None} for t in targets]
    record_served(entries, targets, transport=fake_server({"tripod": [TRIPOD_CARD], "llama": [LLAMACPP_CARD]}))
    assert entries[0]["served"][0]["compute"] == {"backend": "cpu", "isa": "avx2"} and "served_error" not in entries[0]
    assert entries[2]["served"] is None and entries[2]["served_error"].startswith("connection")
    assert served_text(entries[0]).startswith("SmolLM2-135M-Instruct: cpu avx2, bfloat16, weights dequantized")
    assert served_text({"served": [{"id": "m", "compute": {"backend": "reference", "reason": "no AVX2"},
                                    "dtype": "float32"}]}) == "m: reference (no AVX2), float32"
    assert served_text({"served": [LLAMACPP_CARD]}) == "smollm2.gguf: owned by llamacpp"
    assert served_text({"label": "old"}) == "not asked (an older record)"

    config = {"machine": describe(ZEN3, cores=2), "targets": entries}
    write_html(tmp_path / "report.html", config, [])
    page = (tmp_path / "report.html").read_text()
    assert "AMD EPYC 7B13 (AuthenticAMD family 25 model 1 stepping 0), 2 cores, ISA avx2" in page
    assert "tripod (http://tripod:8000): SmolLM2-135M-Instruct: cpu avx2" in page
    assert "llama.cpp (http://llama:8080): smollm2.gguf: owned by llamacpp" in page
    assert "gone (http://down:1): GET /v1/models failed: connection" in page
    # A comparison shows each folder's machine; records from before this show what they have.
    write_html(tmp_path / "cmp.html", {"compare": [{"dir": "zen4-run", **config, "machine": describe(ZEN4)},
                                                   {"dir": "old", "machine": {"cores": 2}, "targets": [{"label": "t"}]}]},
               [])
    page = (tmp_path / "cmp.html").read_text()
    assert "<b>zen4-run</b>: AMD EPYC 9B14" in page and "ISA avx512_bf16" in page
    assert "<b>old</b>: unknown CPU, 2 cores" in page and "not asked (an older record)" in page


@pytest.mark.parametrize("text", [ZEN3, ""])
def test_machine_module_runs_alone(tmp_path: Path, text: str) -> None:
    """``python -m tripod.bench.machine [FILE]``: no torch, JSON out."""
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    code = ("import runpy, sys\nsys.argv = ['m', sys.argv[1]]\ntry:\n"
            "    runpy.run_module('tripod.bench.machine', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code\nassert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["isa_level"] == ("avx2" if text else "baseline")
