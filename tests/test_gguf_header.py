"""Our GGUF header reader (``gguf_header.read_header``) against gguf-py's ``GGUFReader`` on files gguf-py's writer
made: the same metadata, tensor table and data offset; the tokenizer's arrays stepped over with their lengths kept.
A damaged or hostile header (cut anywhere, bytes flipped, impossible counts, another byte order) is refused with a
:class:`GGUFError` that says what is wrong, never another exception and never a hang."""

import os
import struct

import gguf
import numpy as np
import pytest

from optimum_ipex_spec.kernels.gguf_header import GGUFError, read_header

TOKENS = [f"tok{i}" for i in range(300)] + ["ünï", ""]


def write_file(path, alignment=None, tensors=True) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 0.25])
    writer.add_array("t.strings", ["a", "bc", ""])
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * len(TOKENS))
    writer.add_token_merges(["t o", "o k"])
    writer.add_bos_token_id(1)
    if tensors:
        writer.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
        writer.add_tensor("b.weight", np.zeros((3, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor("c.bias", np.ones(5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _same_as_gguf_py(path):
    header = read_header(path)
    reader = gguf.GGUFReader(path, "r")
    assert header.data_offset == reader.data_offset
    assert header.alignment == reader.alignment
    assert header.size == os.path.getsize(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own version and counts
            continue
        value = field.contents()
        if key.startswith("tokenizer.") and isinstance(value, list):
            assert key not in header.fields and header.array_lengths[key] == len(value), key
        else:
            assert header.fields[key] == value and type(header.fields[key]) is type(value), key
            if isinstance(value, list):
                assert header.array_lengths[key] == len(value), key
    assert len(header.fields) == len([k for k, f in reader.fields.items() if not k.startswith("GGUF.")
                                      and not (k.startswith("tokenizer.") and isinstance(f.contents(), list))])
    assert [(t.name, t.dims, t.ggml_type, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    return header


@pytest.mark.parametrize("alignment", [None, 64, 8])
def test_the_header_is_gguf_pys(tmp_path, alignment):
    header = _same_as_gguf_py(write_file(tmp_path / "a.gguf", alignment))
    assert header.fields["t.u64"] == 2**63 + 5 and header.fields["t.str"] == "héllo"
    assert header.fields["t.strings"] == ["a", "bc", ""]
    assert header.array_lengths["tokenizer.ggml.tokens"] == len(TOKENS)
    assert header.fields["tokenizer.ggml.bos_token_id"] == 1, "the tokenizer's scalars are kept"
    assert header.data_offset % (alignment or 32) == 0


def test_a_file_without_tensors(tmp_path):
    header = _same_as_gguf_py(write_file(tmp_path / "a.gguf", tensors=False))
    assert header.tensors == []


def _header_end(path) -> int:
    """Where the data section begins (after the header and its padding)."""
    return read_header(path).data_offset


def test_a_header_cut_anywhere_is_refused_by_name(tmp_path):
    path = write_file(tmp_path / "a.gguf")
    data = open(path, "rb").read()
    last = _header_end(path) - 32  # the table ends within the alignment (32) before the data: cut before that
    cut = tmp_path / "cut.gguf"
    # every byte of the first fields and of the tensor table, and a stride through the tokenizer's strings
    for n in sorted(set(range(0, 400)) | set(range(400, last, 53)) | set(range(last - 150, last + 1))):
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFError, match="not a GGUF file|truncated or damaged"):
            read_header(cut)


def test_flipped_bytes_give_a_header_or_a_named_refusal(tmp_path):
    path = write_file(tmp_path / "a.gguf")
    data = bytearray(open(path, "rb").read())
    end = _header_end(path)
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    refused = 0
    for _ in range(300):
        copy = bytearray(data)
        for at in rng.integers(0, end, size=3):
            copy[at] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(copy))
        try:
            read_header(bad)
        except GGUFError:
            refused += 1
    assert refused > 0


def _minimal(version=3, tensor_count=0, kv=b"", kv_count=None, order="<") -> bytes:
    count = kv_count if kv_count is not None else (1 if kv else 0)
    return b"GGUF" + struct.pack(order + "IQQ", version, tensor_count, count) + kv + b"\0" * 64


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


@pytest.mark.parametrize("body, message", [
    (b"GGML" + b"\0" * 60, "does not begin with GGUF's magic"),
    (b"GGUF\x03\0", "bytes long: not a GGUF file"),
    (_minimal(version=1), "GGUF version 1; this reader reads versions 2 and 3"),
    (_minimal(order=">"), "big-endian GGUF file"),
    (_minimal(kv_count=2**60), "cannot fit"),
    (_minimal(tensor_count=2**40), "cannot fit"),
    (_minimal(kv=_string(b"k") + struct.pack("<I", 13)), "value type 13"),
    (_minimal(kv=_string(b"\xff\xfe") + struct.pack("<IB", 0, 1)), "not UTF-8"),
    (_minimal(kv=_string(b"k") + struct.pack("<IQ", 8, 2**62)), "runs past the end"),
    (_minimal(kv=_string(b"k") + struct.pack("<IIQ", 9, 4, 2**61)), "runs past the end"),
    (_minimal(kv=_string(b"tokenizer.x") + struct.pack("<IIQ", 9, 8, 2**59)), "runs past the end"),
    (_minimal(kv=_string(b"tokenizer.x") + struct.pack("<IIQQ", 9, 8, 2, 2**63)), "runs past the end"),
    (_minimal(kv=_string(b"k") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 5),
     "nested more than 4 deep"),
    (_minimal(kv=_string(b"general.alignment") + struct.pack("<II", 4, 0)), "not a power of two"),
    (_minimal(kv=_string(b"general.alignment") + struct.pack("<II", 4, 24)), "not a power of two"),
    (_minimal(kv=(_string(b"a") + struct.pack("<IB", 0, 1)) * 2, kv_count=2), "key a twice"),
    (_minimal(tensor_count=1) [:24] + _string(b"t") + struct.pack("<I", 5) + b"\0" * 80, "5 dimensions"),
    (_minimal(tensor_count=2)[:24] + (_string(b"t") + struct.pack("<IQIQ", 1, 32, 0, 0)) * 2 + b"\0" * 64,
     "tensor t twice"),
])
def test_impossible_headers_are_refused_by_name(tmp_path, body, message):
    path = tmp_path / "x.gguf"
    path.write_bytes(body)
    with pytest.raises(GGUFError, match=message):
        read_header(path)


def test_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_header(tmp_path / "none.gguf")


def test_a_long_array_is_stepped_over_under_any_key(tmp_path):
    """A crafted file's array as large as the file would take several times its size as Python objects: past
    MAX_KEPT_ARRAY elements only its length is kept, under any key, nested or not."""
    from optimum_ipex_spec.kernels import gguf_header

    n = gguf_header.MAX_KEPT_ARRAY + 1
    big = struct.pack("<IIQ", 9, 0, n) + b"\1" * n
    nested = struct.pack("<IIQ", 9, 9, n) + struct.pack("<IQ", 0, 0) * n
    small = struct.pack("<IIQ", 9, 0, 2) + b"\1\2"
    kv = _string(b"big") + big + _string(b"nested") + nested + _string(b"small") + small
    path = tmp_path / "x.gguf"
    path.write_bytes(_minimal(kv=kv, kv_count=3))
    header = read_header(path)
    assert header.fields == {"small": [1, 2]}
    assert header.array_lengths == {"big": n, "nested": n, "small": 2}
