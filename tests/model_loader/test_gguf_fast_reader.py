"""FastGGUFReader gives gguf.GGUFReader's fields and tensors (its fast paths: arrays of
scalars and of strings), in either byte order, and the same error for a damaged file."""
from __future__ import annotations

import numpy as np
import pytest

from llmserve.model_loader.gguf_fast_reader import FastGGUFReader, fast_gguf_reads


def _write(path: str, endianess=None) -> None:
    import gguf
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(path, "llama", **({"endianess": endianess} if endianess is not None else {}))
    w.add_block_count(2)
    w.add_token_list(["a", "bb", "", "<|im_end|>", "é"] * 30)   # strings, one empty, one multi-byte
    w.add_token_scores([0.5, -1.25] * 75)                          # float32
    w.add_token_types([1, 3] * 75)                                 # int32
    for key, sub, values in (("u8", V.UINT8, [1, 2, 255]), ("i64", V.INT64, [-(2 ** 40), 7]),
                             ("bool", V.BOOL, [True, False]), ("f64", V.FLOAT64, [0.1])):
        w.add_key_value(f"test.{key}", values, V.ARRAY, sub_type=sub)
    w.add_array("test.nested", [[1, 2], [3]])                      # arrays of arrays: GGUFReader's own code
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.flag", True)
    w.add_uint64("test.u64", 2 ** 50)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 32)).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_same(fast, ref) -> None:
    assert list(fast.fields) == list(ref.fields)
    for name, a in fast.fields.items():
        b = ref.fields[name]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), name
        assert len(a.parts) == len(b.parts), name
        for pa, pb in zip(a.parts, b.parts):
            assert (pa.dtype, pa.shape, pa.tobytes()) == (pb.dtype, pb.shape, pb.tobytes()), name
        assert a.contents() == b.contents(), name
    assert [t.field.name for t in fast.tensors] == [t.field.name for t in ref.tensors]
    for a, b in zip(fast.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(np.asarray(a.data), np.asarray(b.data))
    assert (fast.alignment, fast.data_offset, fast.byte_order, fast.endianess) == \
           (ref.alignment, ref.data_offset, ref.byte_order, ref.endianess)


@pytest.mark.parametrize("big_endian", [False, True])
def test_same_fields_and_tensors_as_gguf_reader(tmp_path, big_endian):
    import gguf
    path = str(tmp_path / "t.gguf")
    _write(path, gguf.GGUFEndian.BIG if big_endian else None)
    fast, ref = FastGGUFReader(path), gguf.GGUFReader(path)
    assert not fast._stock
    _assert_same(fast, ref)


def test_a_damaged_file_raises_what_gguf_reader_raises(tmp_path):
    import gguf
    path = tmp_path / "t.gguf"
    _write(str(path))
    data = path.read_bytes()
    start = data.index(b"<|im_end|>")
    for cut in (start + 3, 40):  # inside the vocabulary; inside the first key
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(Exception) as ref:
            gguf.GGUFReader(str(short))
        with pytest.raises(type(ref.value)) as fast:
            FastGGUFReader(str(short))
        assert str(fast.value) == str(ref.value)


def test_fast_gguf_reads_swaps_the_class_for_the_block_only():
    import gguf
    stock = gguf.GGUFReader
    with fast_gguf_reads():
        with fast_gguf_reads():  # re-entrant
            assert gguf.GGUFReader is FastGGUFReader
        assert gguf.GGUFReader is FastGGUFReader
    assert gguf.GGUFReader is stock
