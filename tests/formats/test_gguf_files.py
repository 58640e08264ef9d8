"""Damaged GGUF files: every one eaglet reads (`--target-gguf` for `export --format gguf` and
`eval`'s llama.cpp methods, the f32 copy cached under $EAGLET_HOME/gguf) is checked whole by
`formats.read_gguf`, and a bad one is refused naming the file and what is wrong, never with numpy's
words; a cached f32 copy that is damaged is written again, and its writing is atomic."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest

from eaglet import embedded, formats
from eaglet.cli import main as cli_main
from eaglet.target import f32_target_gguf
from helpers import TOKENS, random_drafter, tiny_config, write_checkpoint

NUMPY_WORDS = ("reshape", "dtype", "divisor", "index", "out of bounds")  # what the unchecked reader said


def quantized_gguf(path: Path) -> Path:
    """A small target GGUF: tiny_config's tokenizer, a Q8_0 matrix and an f32 norm."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", rng.random(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def layout(path: Path) -> dict[str, int]:
    """Byte offsets inside a good GGUF: where its token list, tensor list and tensor data are."""
    reader = gguf.GGUFReader(path)
    return {
        "start": 0,
        "tokens": reader.fields["tokenizer.ggml.tokens"].offset,
        "tensor_info": reader.tensors[0].field.offset,
        "data": reader.data_offset,
        "last_tensor": reader.tensors[-1].data_offset,
    }


def field_part_offset(path: Path, tensor: int, part: int) -> int:
    """The byte offset of one part of a tensor-list entry (3: dimensions, 4: type, 5: data offset)."""
    field = gguf.GGUFReader(path).tensors[tensor].field
    return field.offset + sum(int(p.nbytes) for p in field.parts[:part])


def patched(path: Path, at: int, value: int, width: int = 8) -> Path:
    data = bytearray(path.read_bytes())
    data[at : at + width] = value.to_bytes(width, "little")
    path.write_bytes(bytes(data))
    return path


def refused(path: Path, message: str) -> str:
    """read_gguf's refusal of `path`: it names the file, matches `message`, and has none of numpy's words."""
    with pytest.raises(formats.GGUFDamaged, match=message) as e:
        formats.read_gguf(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ") and "\n" not in text, text
    assert not any(word in text for word in NUMPY_WORDS), text
    return text


@pytest.fixture
def good(tmp_path) -> Path:
    return quantized_gguf(tmp_path / "target.gguf")


def test_a_whole_gguf_reads(good, tmp_path):
    assert [t.name for t in formats.read_gguf(good).tensors] == ["blk.0.attn_q.weight", "output_norm.weight"]
    assert formats.weight_type(good) == "Q8_0"
    formats.write_gguf_as(good, tmp_path / "f32.gguf", "F32")
    assert formats.weight_type(tmp_path / "f32.gguf") == "F32"


def test_the_embedded_gguf_reads():
    try:
        path = embedded.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"the embedded SmolLM2 wheel is not installed: {e}")
    assert len(formats.read_gguf(path).tensors) == 272


@pytest.mark.parametrize(
    "where, plus, message",
    [
        ("start", 0, r"empty \(0 bytes\), not a GGUF; download or copy it again"),
        ("start", 3, "truncated: 3 bytes, fewer than a GGUF's magic and version"),  # inside the magic
        ("start", 6, "truncated: 6 bytes, fewer than a GGUF's magic and version"),  # inside the version
        ("start", 20, "truncated or damaged: 20 bytes, but its header reads on to byte 24"),  # inside the counts
        ("tokens", 40, "truncated or damaged: .* but its header reads on to byte"),  # inside the token list
        ("tensor_info", 5, "truncated or damaged: .* but its header reads on to byte"),  # inside the tensor list
        ("data", 0, "truncated: tensor 'blk.0.attn_q.weight' .* past the file's end"),  # no tensor data at all
        ("last_tensor", 100, r"truncated: tensor 'output_norm.weight' \(F32 \[64\]\) ends at byte"),
    ],
    ids=["empty", "magic", "version", "counts", "keys", "tensor-list", "data-start", "data-end"],
)
def test_a_truncated_gguf_is_refused_naming_it(good, where, plus, message):
    good.write_bytes(good.read_bytes()[: layout(good)[where] + plus])
    assert "download or copy it again" in refused(good, message)


def test_garbage_and_a_wrong_magic_are_not_a_gguf(good, tmp_path):
    rng = np.random.default_rng(1)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(rng.bytes(4096))
    refused(garbage, "not a GGUF: it starts with .*, a GGUF with b'GGUF'; pass the target's GGUF")
    zipped = tmp_path / "model.gguf"
    zipped.write_bytes(b"PK\x03\x04" + good.read_bytes()[4:])
    refused(zipped, "not a GGUF: it starts with b'PK\\\\x03\\\\x04'")
    garbled = tmp_path / "garbled.gguf"  # a right preamble, then garbage: the counts it reads are nonsense
    garbled.write_bytes(good.read_bytes()[:8] + rng.bytes(4096))
    refused(garbled, "truncated or damaged|a damaged GGUF header")


def test_an_unknown_version_is_refused(good):
    refused(
        patched(good, 4, 99, width=4),
        "GGUF version 99, which eaglet's gguf reader does not read; convert the "
        "model again with a llama.cpp converter that writes GGUF version 2 or 3",
    )


def test_a_damaged_header_value_is_refused(good):
    """A key-value's type code that names no GGUF value type: the reader's own error, translated."""
    at = gguf.GGUFReader(good).fields["general.architecture"].offset
    key_bytes = 8 + len("general.architecture")
    refused(patched(good, at + key_bytes, 77, width=4), r"a damaged GGUF header \(.*77")


@pytest.mark.parametrize(
    "tensor, part, value, message",
    [
        (1, 5, 1 << 20, r"truncated: tensor 'output_norm.weight' \(F32 \[64\]\) ends at byte"),
        (1, 3, 1 << 16, r"tensor 'output_norm.weight' \(F32 \[65536\]\) ends at byte .* past the file's end"),
        (0, 3, 33, r"tensor 'blk.0.attn_q.weight' \(Q8_0 \[33, 4\]\) has rows of 33 values, not whole 32-value blocks"),
        (0, 4, 99, "tensor 'blk.0.attn_q.weight' has ggml type code 99, which is no type the gguf package knows"),
        (1, 5, 268, r"tensor 'output_norm.weight' .* starts at data offset 268, off the file's 32-byte alignment"),
    ],
    ids=["offset-past-end", "shape-past-end", "partial-block", "unknown-type", "misaligned"],
)
def test_a_tensor_that_does_not_fit_its_file_is_refused(good, tensor, part, value, message):
    refused(patched(good, field_part_offset(good, tensor, part), value, width=4 if part == 4 else 8), message)


def test_every_reader_of_a_target_gguf_names_it(good, tmp_path, capsys):
    """weight_type, write_gguf_as, f32_target_gguf, and `eaglet export --format gguf --target-gguf`."""
    good.write_bytes(good.read_bytes()[: layout(good)["last_tensor"] + 10])
    for read in (
        formats.weight_type,
        formats.is_quantized,
        f32_target_gguf,
        lambda p: formats.write_gguf_as(p, tmp_path / "f32.gguf"),
    ):
        with pytest.raises(formats.GGUFDamaged, match=f"^{good}: truncated: tensor 'output_norm.weight'"):
            read(good)
    assert not (tmp_path / "f32.gguf").exists()
    ckpt = write_checkpoint(tmp_path, random_drafter(tiny_config()))
    out = tmp_path / "drafter.gguf"
    assert cli_main(["export", str(ckpt), str(out), "--format", "gguf", "--target-gguf", str(good)]) == 2
    err = capsys.readouterr().err
    assert f"{good}: truncated: tensor 'output_norm.weight'" in err and not out.exists()
    assert not any(word in err for word in NUMPY_WORDS), err


def test_a_damaged_cached_f32_copy_is_written_again(good, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EAGLET_HOME", str(tmp_path / "home"))
    cached = f32_target_gguf(good)
    assert cached.parent == tmp_path / "home" / "gguf" and formats.weight_type(cached) == "F32"
    whole = cached.read_bytes()
    cached.write_bytes(whole[: len(whole) // 2])  # cut in its tensor data
    with caplog.at_level(logging.WARNING, logger="eaglet.target"):
        assert f32_target_gguf(good) == cached
    assert cached.read_bytes() == whole and f"{cached}: truncated: tensor" in caplog.text
    cached.write_bytes(b"")  # and an empty one
    assert f32_target_gguf(good) == cached and cached.read_bytes() == whole


def test_the_f32_copy_is_written_atomically(good, tmp_path, monkeypatch):
    """While the copy is written its final name does not exist, and a write stopped midway (a kill,
    Ctrl-C) leaves none: the next run writes it whole instead of reusing part of one."""
    monkeypatch.setenv("EAGLET_HOME", str(tmp_path / "home"))
    folder = tmp_path / "home" / "gguf"
    dequantize, seen = gguf.quants.dequantize, []

    def stopped_at_the_second_tensor(data, qtype):
        seen.append(sorted(p.name for p in folder.iterdir()))
        if len(seen) == 2:
            raise KeyboardInterrupt
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", stopped_at_the_second_tensor)
    with pytest.raises(KeyboardInterrupt):
        f32_target_gguf(good)
    assert all(len(names) == 1 and names[0].startswith(".") and formats.TMP_MARK in names[0] for names in seen), seen
    assert list(folder.iterdir()) == []
    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    assert formats.weight_type(f32_target_gguf(good)) == "F32"
