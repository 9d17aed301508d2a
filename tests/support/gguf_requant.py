"""A GGUF's quantized tensors re-quantized to another GGUF type with gguf-py's own quantizer.

llama.cpp's Python converter writes F32 / F16 / BF16 / Q8_0 only; the 4-bit types come from its C++
``llama-quantize``, which the tests do not build. ``requantized`` copies a converter-made GGUF (its
metadata untouched) with each Q8_0 tensor replaced by ``gguf.quants.quantize`` of its dequantized
values in ``qtype`` (Q4_0, Q4_1, ...): the file llama-quantize would give from the same values, up to
rounding choices that do not matter to a test comparing the file with itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def requantized(src: Path, out: Path, qtype: str) -> Path:
    """``src`` with its Q8_0 tensors in ``qtype`` (a ``gguf.GGMLQuantizationType`` name), written to ``out``."""
    if out.is_file():
        return out
    kind = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    partial = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(partial), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    return out
