"""Every Triton kernel compiled ahead of time for a GPU architecture, without a GPU: Triton lowers
it to PTX and ``ptxas`` (shipped in the triton wheel) assembles it, reporting registers, spills
and shared memory. ``python -m tripod.kernels.gpu compile --target sm_90`` runs it; CI does, so a
kernel that stops compiling for the H100/H200 (or outgrows a block's shared memory) fails there.

The kernels are compiled at the shapes they serve: Llama-3.1-8B's heads (32 over 8, head dim
128), head dims 64 and 256 with GQA ratios 1 and 8, Gemma's soft-cap and window, gpt-oss's sinks,
DeepSeek-V3's MLA (128 heads, 512 + 64), in bfloat16; the W4A16 linear in bf16, fp16 and fp32; the
W8A8 INT8 code product (int8 x int8 -> int32); the W8A16 linear (8-bit codes; group 16 is
NVFP4A16's) in bf16, fp16 and fp32; the hybrid mixers' recurrences (float32 states) at Qwen3.5's gated delta rule and Nemotron-H's Mamba2.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024, 89: 99 * 1024, 100: 227 * 1024}  # bytes per block (opt-in max)
SCALARS_F32 = {"scale", "softcap", "eps"}


@dataclass
class Compiled:
    """One kernel variant's compile result."""

    name: str
    ok: bool
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def _variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """(name, kernel, pointer dtypes by argument, constexprs) of every kernel variant served."""
    from tripod.kernels.gpu.attention import (
        combine_splits_kernel,
        keys_per_step,
        paged_attention_kernel,
    )
    from tripod.kernels.gpu.elementwise import (
        rms_norm_kernel,
        rope_store_kv_kernel,
        silu_mul_kernel,
    )
    from tripod.kernels.gpu.masks import BLOCK as MASK_BLOCK
    from tripod.kernels.gpu.masks import apply_bitmask_kernel
    from tripod.kernels.gpu.mla import mla_decode_kernel

    bf = "*bf16"
    attn_ptrs = {"q_ptr": bf, "kv_ptr": bf, "table_ptr": "*i32", "rows_ptr": "*i32", "lens_ptr": "*i32",
                 "blocks_ptr": "*i32", "out_ptr": bf, "acc_ptr": "*fp32", "ml_ptr": "*fp32", "sinks_ptr": "*fp32"}

    def attn(nh: int, nkv: int, d: int, many: bool, splits: int, **flags: bool) -> dict[str, Any]:
        g = nh // nkv
        bg = 1 << (g - 1).bit_length()
        bm = max((64 if many else 16) // bg, 1)
        return dict(NH=nh, NKV=nkv, D=d, G=g, SPLITS=splits, BLOCK_M=bm, BLOCK_G=bg, BLOCK_N=keys_per_step(d),
                    BLOCK_D=d, SOFTCAP=flags.get("softcap", False), WINDOW=flags.get("window", False),
                    HAS_SINKS=flags.get("sinks", False), FP32_DOT=False)

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = [
        ("rms_norm[4096]", rms_norm_kernel, {"x_ptr": bf, "res_ptr": bf, "w_ptr": bf, "out_ptr": bf, "sum_ptr": bf},
         dict(HAS_RES=False, BLOCK=4096)),
        ("rms_norm+residual[4096]", rms_norm_kernel, {"x_ptr": bf, "res_ptr": bf, "w_ptr": bf, "out_ptr": bf,
                                                      "sum_ptr": bf}, dict(HAS_RES=True, BLOCK=4096)),
        ("silu_mul[14336]", silu_mul_kernel, {"gu_ptr": bf, "out_ptr": bf}, dict(BLOCK=1024)),
        ("apply_bitmask[fp32 logits]", apply_bitmask_kernel, {"logits_ptr": "*fp32", "mask_ptr": "*i32",
                                                               "rows_ptr": "*i64"}, dict(BLOCK=MASK_BLOCK)),
        ("rope_store_kv[32/8x128]", rope_store_kv_kernel,
         {"qkv_ptr": bf, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "kv_ptr": bf, "slot_ptr": "*i64"},
         dict(NH=32, NKV=8, D=128, BLOCK_H=64, BLOCK_HALF=64, BLOCK_KV=8, BLOCK_D=128)),
        ("paged_attention decode[32/8x128]", paged_attention_kernel, attn_ptrs, attn(32, 8, 128, False, 16)),
        ("paged_attention prefill[32/8x128]", paged_attention_kernel, attn_ptrs, attn(32, 8, 128, True, 16)),
        ("paged_attention decode[16/16x64]", paged_attention_kernel, attn_ptrs, attn(16, 16, 64, False, 16)),
        ("paged_attention prefill[16/16x64]", paged_attention_kernel, attn_ptrs, attn(16, 16, 64, True, 16)),
        ("paged_attention decode[16/2x256 softcap window]", paged_attention_kernel, attn_ptrs,
         attn(16, 2, 256, False, 16, softcap=True, window=True)),
        ("paged_attention prefill[16/2x256 softcap window]", paged_attention_kernel, attn_ptrs,
         attn(16, 2, 256, True, 16, softcap=True, window=True)),
        ("paged_attention decode[64/8x64 sinks window]", paged_attention_kernel, attn_ptrs,
         attn(64, 8, 64, False, 16, sinks=True, window=True)),
        ("combine_splits[32x128, 16 splits]", combine_splits_kernel,
         {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": bf, "sinks_ptr": "*fp32"},
         dict(NH=32, D=128, SPLITS=16, BLOCK_S=16, BLOCK_D=128, HAS_SINKS=False)),
        ("mla_decode[128x(512+64)]", mla_decode_kernel,
         {"q_ptr": bf, "lat_ptr": bf, "idx_ptr": "*i64", "lens_ptr": "*i32", "out_ptr": bf, "acc_ptr": "*fp32",
          "ml_ptr": "*fp32"},
         dict(H=128, R=512, P=64, SPLITS=8, BLOCK_H=16, BLOCK_N=16, BLOCK_R=512, BLOCK_P=64, FP32_DOT=False)),
        ("combine_splits[128x512, 8 splits]", combine_splits_kernel,
         {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": bf, "sinks_ptr": "*fp32"},
         dict(NH=128, D=512, SPLITS=8, BLOCK_S=8, BLOCK_D=512, HAS_SINKS=False)),
    ]
    out += _recurrent_variants()
    out += _linear_variants()
    return out


def _linear_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The quantized linears: W4A16, the W8A8 INT8 code product, W8A16 (NVFP4A16's group 16 too)."""
    from tripod.kernels.gpu.w4a16 import BLOCK_M as W4_M
    from tripod.kernels.gpu.w4a16 import blocks as w4_blocks
    from tripod.kernels.gpu.w4a16 import w4a16_kernel
    from tripod.kernels.gpu.w8a8 import BLOCK_K as W8_K
    from tripod.kernels.gpu.w8a8 import BLOCK_M as W8_M
    from tripod.kernels.gpu.w8a8 import BLOCK_N as W8_N
    from tripod.kernels.gpu.w8a8 import w8a8_int8_kernel
    from tripod.kernels.gpu.w8a16 import BLOCK_M as W816_M
    from tripod.kernels.gpu.w8a16 import blocks as w816_blocks
    from tripod.kernels.gpu.w8a16 import w8a16_kernel

    bf = "*bf16"
    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    w4_ptrs = {"q_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8"}
    for act, dt, group, zeros in (("bf16", bf, 128, True), ("bf16", bf, 128, False), ("bf16", bf, 32, True),
                                  ("fp16", "*fp16", 128, True), ("fp32", "*fp32", 128, True)):
        bn, bk = w4_blocks(act == "fp32", group)
        out.append((f"w4a16[{act}, group {group}, {'zero points' if zeros else 'symmetric'}]", w4a16_kernel,
                    {**w4_ptrs, "x_ptr": dt, "out_ptr": dt},
                    dict(HAS_ZEROS=zeros, FP32_DOT=act == "fp32", BLOCK_M=W4_M, BLOCK_N=bn, BLOCK_K=bk)))
    out.append(("w8a8_int8[int8 x int8 -> int32]", w8a8_int8_kernel,
                {"x_ptr": "*i8", "w_ptr": "*i8", "out_ptr": "*i32"}, dict(BLOCK_M=W8_M, BLOCK_N=W8_N, BLOCK_K=W8_K)))
    for act, dt, group, zeros in (("bf16", bf, 128, False), ("bf16", bf, 128, True), ("bf16", bf, 16, False),
                                  ("fp16", "*fp16", 128, False), ("fp32", "*fp32", 128, True), ("fp32", "*fp32", 16, False)):
        bn, bk = w816_blocks(act == "fp32", group)
        out.append((f"w8a16[{act}, group {group}{', zero points' if zeros else ''}]", w8a16_kernel,
                    {"x_ptr": dt, "w_ptr": "*i8", "s_ptr": "*fp32", "z_ptr": "*i8", "out_ptr": dt},
                    dict(HAS_ZEROS=zeros, FP32_DOT=act == "fp32", BLOCK_M=W816_M, BLOCK_N=bn, BLOCK_K=bk)))
    return out


def _recurrent_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The hybrid mixers' kernels (float32 states; the conv reads the bf16 projection)."""
    from tripod.kernels.gpu.recurrent import (
        conv_update_kernel,
        gated_delta_kernel,
        ssd_scan_kernel,
        value_block,
    )

    bf = "*bf16"
    f32 = "*fp32"
    conv_ptrs = {"x_ptr": bf, "win_ptr": f32, "w_ptr": f32, "b_ptr": f32, "out_ptr": f32, "items_ptr": "*i32"}
    return [
        # Qwen3.5 / Qwen3-Next: 16 key heads, 32 value heads, 128 x 128, conv over 8192 channels (kernel 4)
        ("conv_update[8192, kernel 4]", conv_update_kernel, conv_ptrs,
         dict(K=4, HAS_BIAS=False, SILU=True, BLOCK_C=256, BLOCK_K=4)),
        ("conv_update[10240, kernel 4, bias]", conv_update_kernel, conv_ptrs,
         dict(K=4, HAS_BIAS=True, SILU=True, BLOCK_C=256, BLOCK_K=4)),
        ("gated_delta[32/16 heads x 128x128]", gated_delta_kernel,
         {"q_ptr": f32, "k_ptr": f32, "v_ptr": f32, "decay_ptr": f32, "beta_ptr": f32, "state_ptr": f32,
          "out_ptr": f32, "items_ptr": "*i32"},
         dict(HV=32, HK=16, DK=128, DV=128, BLOCK_K=128, BLOCK_V=value_block(128))),
        # Nemotron-H 8B's Mamba2: 128 heads x 64, state 128, 8 groups
        ("ssd_scan[128x64, state 128, 8 groups]", ssd_scan_kernel,
         {"x_ptr": f32, "b_ptr": f32, "c_ptr": f32, "dt_ptr": f32, "decay_ptr": f32, "state_ptr": f32,
          "out_ptr": f32, "items_ptr": "*i32"},
         dict(H=128, G=8, P=64, N=128, BLOCK_P=32, BLOCK_N=128)),
    ]


def _signature(kernel: Any, ptrs: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        elif name.endswith("_ptr"):
            raise KeyError(f"{kernel.fn.__name__}: no dtype given for pointer {name}")
        else:
            sig[name] = "fp32" if name in SCALARS_F32 else "i32"
    return sig


def _ptxas_report(ptx: str, arch: int) -> tuple[int | None, int | None, int | None]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", src, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None,
            int(spills.group(2)) if spills else None)


def compile_all(arch: int = 90, only: str | None = None, max_shared: int | None = None) -> list[Compiled]:
    """Compile every kernel variant for ``sm_<arch>``. Triton's interpreter must be off."""
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile the kernels (the interpreter compiles nothing)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tripod.kernels.gpu.attention import NUM_WARPS, paged_attention_kernel

    limit = max_shared if max_shared is not None else SHARED_LIMIT.get(arch, 99 * 1024)
    results = []
    for name, kernel, ptrs, consts in _variants():
        if only and only not in name:
            continue
        try:
            src = ASTSource(kernel, signature=_signature(kernel, ptrs, consts), constexprs=consts)
            warps = NUM_WARPS if kernel is paged_attention_kernel else 4
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        except Exception as e:
            results.append(Compiled(name, False, error=f"{type(e).__name__}: {' | '.join(str(e).splitlines()[-3:])[:400]}"))
            continue
        regs, st, ld = _ptxas_report(k.asm["ptx"], arch)
        c = Compiled(name, True, regs, st, ld, int(k.metadata.shared))
        if c.shared > limit:
            c.ok = False
            c.error = f"needs {c.shared} bytes of shared memory per block; sm_{arch} allows {limit}"
        if st:
            c.notes.append(f"spills {st} bytes")
        results.append(c)
    return results
