"""The target's own GGUF (llama.cpp's copy of the target model): read and checked whole
(`read_gguf`), what its weights are stored as, and the same file with every tensor dequantized to f32.

Every GGUF eaglet reads goes through `read_gguf`: the `gguf` package's reader trusts the header, so
a file cut short or not a GGUF at all fails deep in numpy ("cannot reshape array of size ...");
here every byte the header points at is checked to lie within the file first, and the failure
names the file, what is wrong with it and what to do.

Why an f32 copy: llama.cpp runs a quantized target with quantized kernels (Q4_1 weights, and
activations quantized to 8 bits inside each matmul), so its hidden states and greedy answers part
from the model eaglet trained the drafter on. For the embedded default the two share their weights
exactly (eaglet's cached model *is* the GGUF dequantized, target.py), so on the f32 copy llama.cpp
and eaglet run the same model and any difference left is the drafter's conventions at the export.
"""

from __future__ import annotations

import functools
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from eaglet.formats.io import REDO, atomic_path

UNQUANTIZED = ("F32", "F16", "BF16", "F64")  # ggml tensor types that are plain floats
GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS: llama.cpp refuses a tensor with more
NOT_GGUF = "pass the target's GGUF (the model file llama.cpp runs)"


class GGUFDamaged(ValueError):
    """A file that is not a whole GGUF, said in one line: the file, what is wrong, what to do."""

    def __init__(self, path: str | os.PathLike, what: str, todo: str = REDO):
        super().__init__(f"{path}: {what}; {todo}")
        self.path, self.what, self.todo = Path(path), what, todo


class Fault(Exception):
    """What is wrong with a GGUF, raised inside the reader, which does not know the file's path."""


def preamble_problem(head: bytes, size: int, versions: list[int]) -> tuple[str, str] | None:
    """(what is wrong, what to do) with a file of `size` bytes that starts with `head` (its first
    8 bytes) as a GGUF whose version is one of `versions`; None when the magic and version are right."""
    if size == 0:
        return "empty (0 bytes), not a GGUF", REDO
    if not (GGUF_MAGIC.startswith(head) or head.startswith(GGUF_MAGIC)):
        return f"not a GGUF: it starts with {head[:4]!r}, a GGUF with {GGUF_MAGIC!r}", NOT_GGUF
    if len(head) < 8:
        return f"truncated: {size} bytes, fewer than a GGUF's magic and version", REDO
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0:  # written big-endian: the reader reads it byte-swapped
        version = int.from_bytes(head[4:8], "big")
    if version not in versions:
        readable = " or ".join(map(str, versions))
        return (
            f"GGUF version {version}, which eaglet's gguf reader does not read",
            f"convert the model again with a llama.cpp converter that writes GGUF version {readable}",
        )
    return None


def tensor_problem(
    name: str, raw_type: int, dims: list[int], offset: int, data_start: int, alignment: int, size: int
) -> str | None:
    """What is wrong with one entry of a GGUF's tensor list (ggml type, dimensions in ggml's order,
    offset within the data section that starts at byte `data_start`) in a file of `size` bytes:
    the type unknown, rows not whole quantization blocks, data misaligned or running past the end."""
    import gguf  # 0.17 s to import (numpy, yaml): only where a GGUF is read or written

    try:
        ggml_type = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        return f"tensor {name!r} has ggml type code {raw_type}, which is no type the gguf package knows"
    shape = f"{ggml_type.name} {dims}"
    if len(dims) > MAX_DIMS:
        return f"tensor {name!r} ({shape}) has {len(dims)} dimensions, more than ggml's {MAX_DIMS}"
    block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    if dims and dims[0] % block:
        return f"tensor {name!r} ({shape}) has rows of {dims[0]} values, not whole {block}-value blocks of its type"
    if offset % alignment:
        return f"tensor {name!r} ({shape}) starts at data offset {offset:,}, off the file's {alignment}-byte alignment"
    end = data_start + offset + math.prod(dims) // block * block_bytes
    if end > size:
        return f"truncated: tensor {name!r} ({shape}) ends at byte {end:,}, past the file's end at byte {size:,}"
    return None


@functools.cache
def checked_reader() -> type:
    """`gguf.GGUFReader` that refuses, as a Fault, any read past the file's end and any tensor
    `tensor_problem` finds. Built on internals of the gguf version pyproject pins (`_get`, every
    read of the header; `_build_tensors`, the one that maps tensor data): check them on an upgrade."""
    import gguf  # 0.17 s to import (numpy, yaml): only where a GGUF is read or written

    class CheckedReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            # unchecked, a cut header reads short arrays that fail as numpy's "size must be a divisor"
            # or, for arrays of bytes, loop on for as many items as the (garbage) count says
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise Fault(f"truncated or damaged: {len(self.data):,} bytes, but its header reads on to byte {end:,}")
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                problem = tensor_problem(
                    bytes(name).decode("utf-8", "replace"),
                    int(raw_type[0]),
                    [int(d) for d in dims],
                    int(offset[0]),
                    start_offs,
                    self.alignment,
                    len(self.data),
                )
                if problem:
                    raise Fault(problem)
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def parse_error(e: Exception) -> str:
    """A reader's exception as words (a KeyError's str() is its key in quotes)."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e) or type(e).__name__


def read_gguf(path: str | os.PathLike) -> Any:
    """The GGUF at `path` as a `gguf.GGUFReader`, refused as a GGUFDamaged unless it is a whole GGUF:
    magic and version, a header that parses, every tensor of a known type with its data inside the file."""
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS  # 0.17 s to import: only where a GGUF is read

    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
    problem = preamble_problem(head, path.stat().st_size, READER_SUPPORTED_VERSIONS)
    if problem:
        raise GGUFDamaged(path, *problem)
    try:
        return checked_reader()(path)
    except Fault as e:
        raise GGUFDamaged(path, str(e)) from e
    except (ValueError, KeyError, IndexError, OverflowError) as e:  # what the reader raises on bytes it cannot parse
        raise GGUFDamaged(path, f"a damaged GGUF header ({parse_error(e)})") from e


def weight_type(path: str | os.PathLike) -> str | None:
    """The ggml type most of the file's matrices are stored in ("Q4_1", "F16", ...); None for a
    file without any (a tokenizer-only GGUF)."""
    counts = Counter(t.tensor_type.name for t in read_gguf(path).tensors if len(t.shape) > 1)
    return counts.most_common(1)[0][0] if counts else None


def is_quantized(path: str | os.PathLike) -> bool:
    return weight_type(path) not in (None, *UNQUANTIZED)


def write_gguf_as(src: str | os.PathLike, dst: str | os.PathLike, weights: str = "F32") -> int:
    """`src` with its tensors stored as `weights` ("F32": every tensor dequantized; "Q8_0": then
    every matrix whose rows split into ggml's 32-value blocks quantized to 8 bits, the rest f32)
    and its metadata (tokenizer, chat template, hyperparameters) unchanged but
    `general.file_type`, written atomically; returns the bytes written."""
    import gguf  # 0.17 s to import (numpy, yaml): only where a GGUF is read or written

    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    if weights not in file_types:
        raise ValueError(f"a target GGUF is rewritten as one of {', '.join(file_types)}, not {weights}")
    reader = read_gguf(src)
    if "general.architecture" not in reader.fields:
        raise ValueError(f"{src}: no general.architecture key, so not the GGUF of a model; {NOT_GGUF}")
    arch = reader.fields["general.architecture"].contents()
    with atomic_path(Path(dst)) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":  # the writer's own header fields
                continue
            if name == "general.file_type":
                writer.add_uint32(name, int(file_types[weights]))
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
        for t in reader.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            if weights == "Q8_0" and values.ndim == 2 and values.shape[-1] % 32 == 0:
                q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(t.name, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(t.name, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return os.path.getsize(tmp)
