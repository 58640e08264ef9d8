"""The target's own GGUF (llama.cpp's copy of the target model): what its weights are stored as,
and the same file with every tensor dequantized to f32.

Why an f32 copy: llama.cpp runs a quantized target with quantized kernels (Q4_1 weights, and
activations quantized to 8 bits inside each matmul), so its hidden states and greedy answers part
from the model eaglet trained the drafter on. For the embedded default the two share their weights
exactly (eaglet's cached model *is* the GGUF dequantized, target.py), so on the f32 copy llama.cpp
and eaglet run the same model and any difference left is the drafter's conventions at the export.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np

from eaglet.formats.io import atomic_path

UNQUANTIZED = ("F32", "F16", "BF16", "F64")  # ggml tensor types that are plain floats


def weight_type(path: str | os.PathLike) -> str | None:
    """The ggml type most of the file's matrices are stored in ("Q4_1", "F16", ...); None for a
    file without any (a tokenizer-only GGUF)."""
    import gguf  # 0.17 s to import (numpy, yaml): only where a GGUF is read or written

    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)
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
    reader = gguf.GGUFReader(src)
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

