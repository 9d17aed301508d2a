"""tripod's fast GGUF reader reads exactly what ``gguf.GGUFReader`` reads: every metadata value and
every tensor (name, type, shape, bytes), on the embedded model and on a file with every value type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tripod.loader.embedded import embedded_model_path
from tripod.loader.gguf_reader import GGUFMetadataReader


def _same(path: Path) -> None:
    ref = gguf.GGUFReader(str(path))
    fast = GGUFMetadataReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # GGUFReader's own header pseudo-fields
    assert sorted(keys) == sorted(fast.fields)
    for k in keys:
        assert fast.fields[k].contents() == ref.fields[k].contents(), k
    assert len(fast.tensors) == len(ref.tensors)
    for a, b in zip(ref.tensors, fast.tensors, strict=True):
        assert (b.name, b.tensor_type, b.n_elements) == (a.name, a.tensor_type, int(a.n_elements))
        assert b.shape == tuple(int(x) for x in a.shape)
        assert b.data.shape == a.data.shape and b.data.dtype == a.data.dtype
        assert np.array_equal(np.asarray(a.data).view(np.uint8), b.data.view(np.uint8)), a.name


def test_embedded_model_reads_identically() -> None:
    _same(embedded_model_path())


def test_every_value_type_and_tensor_kind(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("u8", 200)
    w.add_int8("i8", -5)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -3)
    w.add_uint32("u32", 4_000_000_000)
    w.add_int32("i32", -7)
    w.add_float32("f32", 1.5)
    w.add_uint64("u64", 2**40)
    w.add_int64("i64", -(2**40))
    w.add_float64("f64", 2.25)
    w.add_bool("yes", True)
    w.add_string("s", "héllo ✓")
    w.add_array("ints", [1, 2, 3])
    w.add_array("floats", [0.5, -1.0])
    w.add_array("strings", ["a", "", "ü" * 5])
    w.add_array("empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(5).astype(np.float32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFMetadataReader(bad)
