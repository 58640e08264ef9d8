"""The target's heads, read alone: its input embeddings, final norm and LM head, straight from the
checkpoint's safetensors files, without building the model or opening a layer's shard.

Offline training, `convert --layout compact`, `check` without a layer recompute, `export` and
`import` use nothing else of the target. Reading only these keeps a trillion-parameter target's
training step within a few GB of host memory per process: Kimi-K2.5's heads are two 163,840 x 7,168
bf16 matrices (4.7 GB) and a norm, of a checkpoint near 600 GB. A folder with the config, the
tokenizer and only the shards that hold the heads is enough, and it is the same target as the full
folder: a target's identity (`heads_identity`) is its config, its tokenizer and its heads' bytes.

Names are found in the checkpoint's index (`model.safetensors.index.json`) or its single
`model.safetensors`: `<base>embed_tokens.weight`, `<base>norm.weight` and `<outer>lm_head.weight`,
where `<base>` is `model.` or a multimodal model's `language_model.model.` (Kimi-K2.5) or
`model.language_model.`; tied embeddings have no LM head of their own. A head stored in FP8 with
block scales (`weight_scale_inv`, DeepSeek-V3's format for its layers) is dequantized; any other
quantized head is refused with the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eaglet import formats
from eaglet.options import REMOTE_CODE_ENV, env_switch

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EMBEDDINGS, FINAL_NORM, LM_HEAD = "embeddings", "final_norm", "lm_head"
HEAD_ROLES = (EMBEDDINGS, FINAL_NORM, LM_HEAD)
# Where the decoder's embeddings and norm live (`<base>embed_tokens.weight`): a plain causal LM,
# a multimodal one that wraps it (Kimi-K2.5, Llava-style), transformers 5's own multimodal layout.
HEAD_BASES = ("model.", "language_model.model.", "model.language_model.", "")
# The files that, with the heads, say which target this is; a partial download has them all.
IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# A head's identity hashes its dtype, shape and this many evenly spaced byte chunks (every byte of
# a small one): a fine-tune changes every row of an LM head, and reading 4 MiB of a 2.3 GB head
# keeps resolving a target instant.
IDENTITY_CHUNKS, IDENTITY_CHUNK_BYTES = 64, 64 << 10
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Quantized layers store these beside (or instead of) `.weight`: their presence names the scheme.
QUANTIZED_SUFFIXES = {
    "weight_packed": "compressed-tensors packed integers",
    "qweight": "GPTQ/AWQ packed integers",
    "weight_scale": "a per-channel scale",
    "SCB": "bitsandbytes int8",
}


class HeadsNotFound(ValueError):
    """The checkpoint's names do not say where the heads are (an architecture this reader does not know)."""


# ---------------------------------------------------------------------------------------------
# Where the heads are: names, shards, dtypes (headers only)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, from its header: enough to read or hash its bytes."""

    name: str
    file: Path
    dtype: str  # safetensors' name: BF16, F32, F8_E4M3...
    shape: tuple[int, ...]
    start: int  # absolute byte offsets of its data in the file
    end: int


@dataclass(frozen=True)
class HeadLocation:
    """Where a checkpoint keeps its heads: role -> stored tensor (the LM head is the embeddings'
    when tied), the FP8 block scales of a quantized one, and every shard the checkpoint names."""

    folder: Path
    tensors: dict[str, StoredTensor]
    scales: dict[str, StoredTensor]
    tied: bool
    shards: tuple[str, ...]

    @property
    def head_shards(self) -> tuple[str, ...]:
        return tuple(sorted({t.file.name for t in [*self.tensors.values(), *self.scales.values()]}))

    @property
    def missing_shards(self) -> tuple[str, ...]:
        """Shards the checkpoint names that this folder does not have (a head-only download)."""
        return tuple(s for s in self.shards if not (self.folder / s).is_file())

    def stored_bytes(self) -> int:
        tensors = {t.name: t for t in [*self.tensors.values(), *self.scales.values()]}
        return sum(t.end - t.start for t in tensors.values())


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, offset where tensor data starts) of a safetensors file, refused when it is not one."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > path.stat().st_size:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or damaged ({e})") from e
    return header, 8 + size


def weight_file_problem(path: Path) -> str | None:
    """What makes one safetensors weight file unreadable (a header that does not parse, a tensor
    whose bytes lie past the end of the file), or None; from the header alone."""
    try:
        header, start = read_header(path)
    except ValueError as e:
        return str(e)
    size = path.stat().st_size
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        end = start + int((entry.get("data_offsets") or [0, 0])[1])
        if end > size:
            return f"{path}: truncated: tensor {name} ends at byte {end:,}, the file has {size:,}"
    return None


def damaged_weights(folder: Path, error: BaseException) -> ValueError:
    """A weight load that failed inside safetensors, as an error naming the damaged file."""
    problems = [p for f in sorted(folder.glob("*.safetensors")) if (p := weight_file_problem(f))]
    what = problems[0] if problems else f"{folder}: a weight file is not readable safetensors ({error})"
    return ValueError(f"{what}; {formats.io.REDO}")


def weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index, else from the single file's header."""
    if (folder / INDEX_FILE).is_file():
        return formats.read_weight_index(folder / INDEX_FILE)
    if (folder / SINGLE_FILE).is_file():
        return {name: SINGLE_FILE for name in read_header(folder / SINGLE_FILE)[0] if name != "__metadata__"}
    raise HeadsNotFound(
        f"{folder}: no {INDEX_FILE} and no {SINGLE_FILE}; eaglet reads a target's heads from safetensors files"
    )


def stored_tensor(folder: Path, shard: str, name: str) -> StoredTensor:
    """A tensor's header entry; its shard must be in the folder (`--include` it when downloading)."""
    path = formats.inside_folder(folder, shard, str(folder / INDEX_FILE))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; it holds {name}, which eaglet reads from the target (download it "
            f"too: `huggingface-cli download REPO {shard} ...`, docs/large-targets.md)"
        )
    header, data_start = read_header(path)
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: has no tensor {name}, which {folder / INDEX_FILE} places there")
    start, end = entry["data_offsets"]
    return StoredTensor(name, path, entry["dtype"], tuple(entry["shape"]), data_start + start, data_start + end)


def head_names(names: dict[str, str], tie_word_embeddings: bool) -> dict[str, str]:
    """role -> tensor name; the LM head is the embeddings' name when tied (none of its own)."""
    for base in HEAD_BASES:
        embed, norm = f"{base}embed_tokens.weight", f"{base}norm.weight"
        if embed in names and norm in names:
            outer = base.removesuffix("model.") if base.endswith("model.") else ""
            heads = [f"{outer}lm_head.weight", "lm_head.weight"]
            lm_head = next((h for h in heads if h in names), None)
            if lm_head is None and not tie_word_embeddings:
                raise HeadsNotFound(f"no {heads[0]} and tie_word_embeddings is false: the checkpoint names no LM head")
            return {EMBEDDINGS: embed, FINAL_NORM: norm, LM_HEAD: lm_head or embed}
    raise HeadsNotFound(
        f"no <base>embed_tokens.weight with <base>norm.weight for any base in {[b or '(none)' for b in HEAD_BASES]}"
    )


def quantized_scheme(names: dict[str, str], name: str, dtype: str) -> str | None:
    """Why a head cannot be read as it is stored, or None when it can (float, or FP8 with block scales)."""
    prefix = name.removesuffix(".weight")
    beside = [what for suffix, what in QUANTIZED_SUFFIXES.items() if f"{prefix}.{suffix}" in names]
    if beside:
        return beside[0]
    if dtype in FLOAT_DTYPES or (dtype.startswith("F8_") and f"{name}_scale_inv" in names):
        return None
    return f"dtype {dtype}" + (" without weight_scale_inv" if dtype.startswith("F8_") else "")


def locate_heads(folder: str | Path, text: dict[str, Any] | None = None) -> HeadLocation:
    """Where `folder`'s checkpoint keeps its heads, from headers alone (no tensor is read)."""
    folder = Path(folder)
    text = text if text is not None else text_config_dict(folder)
    names = weight_map(folder)
    roles = head_names(names, bool(text.get("tie_word_embeddings", False)))
    tensors, scales = {}, {}
    for role, name in roles.items():
        t = stored_tensor(folder, names[name], name)
        why = quantized_scheme(names, name, t.dtype)
        if why:
            raise ValueError(
                f"{t.file}: the target's {role.replace('_', ' ')} {name} is stored quantized ({why}); "
                "eaglet reads heads stored as floats, or FP8 with block scales (weight_scale_inv): "
                "dequantize this tensor to bf16 first"
            )
        tensors[role] = t
        if t.dtype.startswith("F8_"):
            scales[role] = stored_tensor(folder, names[f"{name}_scale_inv"], f"{name}_scale_inv")
    shards = tuple(sorted(set(names.values())))
    return HeadLocation(folder, tensors, scales, roles[LM_HEAD] == roles[EMBEDDINGS], shards)


def text_config_dict(folder: Path) -> dict[str, Any]:
    """config.json's text part (a multimodal model's `text_config`), as stored."""
    raw = formats.read_json(folder / "config.json")
    text = raw.get("text_config") if isinstance(raw, dict) else None
    if isinstance(text, dict):
        return {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **text}
    if not isinstance(raw, dict):
        raise ValueError(f"{folder / 'config.json'}: not a JSON object")
    return raw


# A model folder's own Python code (config.json / tokenizer_config.json `auto_map`) runs only when
# asked: `eaglet --trust-remote-code STAGE ...` sets this for the process and the engines it starts.
REMOTE_CODE_HINT = (
    f"eaglet runs no code from a model folder unless told to: pass --trust-remote-code (eaglet "
    f"--trust-remote-code STAGE ..., or set {REMOTE_CODE_ENV}=1) if you trust that code"
)


def trust_remote_code() -> bool:
    """Whether a model folder's own code may run (never, unless EAGLET_TRUST_REMOTE_CODE=1)."""
    return env_switch(REMOTE_CODE_ENV, "run a model folder's own code", "never run it") is True


def text_config(folder: str | Path) -> Any:
    """The target's text config as a transformers config, read without weights. A model type
    transformers knows only through the checkpoint's own code (Kimi-K2.5's `kimi_k25`) is read from
    its `text_config`, which is a plain DeepSeek-V3 one: eaglet never runs a checkpoint's code."""
    from transformers import AutoConfig, PretrainedConfig  # seconds to import: only where a target is read

    folder = Path(folder)
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code()).get_text_config()
    except (ValueError, KeyError):
        text = dict(text_config_dict(folder))
        kind = text.pop("model_type", "")
        try:
            return AutoConfig.for_model(kind, **text)
        except ValueError:  # a model type transformers does not know: its fields, read as data
            return PretrainedConfig(**text)


# ---------------------------------------------------------------------------------------------
# Identity: config + tokenizer + the heads' bytes
# ---------------------------------------------------------------------------------------------


def tensor_chunks(t: StoredTensor) -> list[tuple[int, int]]:
    """(offset, size) of the byte ranges a tensor's identity reads: all of it when small."""
    size = t.end - t.start
    if size <= IDENTITY_CHUNKS * IDENTITY_CHUNK_BYTES:
        return [(t.start, size)]
    step = (size - IDENTITY_CHUNK_BYTES) // (IDENTITY_CHUNKS - 1)
    return [(t.start + i * step, IDENTITY_CHUNK_BYTES) for i in range(IDENTITY_CHUNKS)]


def heads_identity(location: HeadLocation) -> str:
    """A content hash of what the heads-only stages read: config.json, the tokenizer files and the
    heads (dtype, shape, sampled bytes). The full folder and a download of only the head shards give
    the same hash; another model's config, tokenizer or heads another. A fine-tune that changed only
    the layers has the same heads: `eaglet check DATA --target FULL` tells it apart (layer identity)."""
    h = hashlib.sha256(b"eaglet heads identity 1")
    for name in IDENTITY_FILES:
        path = location.folder / name
        if path.is_file():
            h.update(f"{name}\0{path.stat().st_size}\0".encode())
            h.update(path.read_bytes())
    for role in HEAD_ROLES:
        t = location.tensors[role]
        h.update(f"{role}\0{t.dtype}\0{t.shape}\0".encode())
        with open(t.file, "rb") as f:
            for offset, size in tensor_chunks(t):
                f.seek(offset)
                h.update(f.read(size))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Reading the heads
# ---------------------------------------------------------------------------------------------


class TargetRMSNorm(nn.Module):
    """The final RMS norm as Llama, Qwen and DeepSeek compute it (in fp32, then the input dtype,
    times the weight); Gemma's multiplies by (1 + weight)."""

    def __init__(self, weight: torch.Tensor, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


@dataclass
class TargetHeads:
    """What the heads-only stages use of a target: its text config, input embeddings [V, H], final
    norm and LM head (a Linear whose weight is the embeddings' when tied)."""

    config: Any
    embeddings: torch.Tensor | None  # None: a role `read_heads` was not asked for
    final_norm: nn.Module | None
    lm_head: nn.Linear | None
    source: str  # where they came from, for messages

    def need(self, role: str, value: Any) -> Any:
        if value is None:
            raise ValueError(f"{self.source}: the target's {role} was not read")
        return value

    def embedding_table(self) -> torch.Tensor:
        return self.need(EMBEDDINGS, self.embeddings)

    def norm(self) -> nn.Module:
        return self.need(FINAL_NORM, self.final_norm)

    def head(self) -> nn.Linear:
        return self.need(LM_HEAD, self.lm_head)


def read_tensor(
    t: StoredTensor,
    dtype: torch.dtype | None,
    device: torch.device,
    scale: StoredTensor | None = None,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """One stored tensor in `dtype` (None: as stored, FP8 as bf16) on `device`: read from the file
    into a host buffer of its stored size, then moved and cast (on a GPU the cast runs there, so
    the host never holds more than one stored copy)."""
    buf = torch.empty(t.end - t.start, dtype=torch.uint8)
    with open(t.file, "rb") as f:
        f.seek(t.start)
        if f.readinto(buf.numpy().data) != t.end - t.start:
            raise ValueError(f"{t.file}: truncated inside {t.name}; download it again")
    stored = buf.view(SAFETENSORS_DTYPES[t.dtype]).reshape(t.shape).to(device)
    del buf
    if scale is None:
        return stored if dtype is None else stored.to(dtype)
    s = read_tensor(scale, torch.float32, device)
    rows, cols = t.shape
    s = s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (stored.float() * s).to(dtype or torch.bfloat16)


def fp8_block(config: Any) -> tuple[int, int]:
    """DeepSeek-V3's FP8 block size (quantization_config.weight_block_size), 128 x 128 by default."""
    quant = getattr(config, "quantization_config", None) or {}
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    return tuple(block) if block else (128, 128)


def final_norm(config: Any, weight: torch.Tensor) -> nn.Module:
    eps = getattr(config, "rms_norm_eps", None)
    if eps is None:
        raise HeadsNotFound(
            f"config has no rms_norm_eps; the head-only reader knows RMS-normed targets only "
            f"(model_type {getattr(config, 'model_type', '?')})"
        )
    return TargetRMSNorm(weight, eps, unit_offset=str(getattr(config, "model_type", "")).startswith("gemma"))


def read_heads(
    folder: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    roles: tuple[str, ...] = HEAD_ROLES,
    config: Any = None,
) -> TargetHeads:
    """The target's heads in `dtype` (None: as stored) on `device`; only `roles` are read, the
    others are None. Nothing else of the checkpoint is opened."""
    folder = Path(folder)
    config = config if config is not None else text_config(folder)
    location = locate_heads(folder, config.to_dict())
    device = torch.device(device)
    block = fp8_block(config)
    read = {}
    for role in roles:
        t = location.tensors[role]
        if t.name not in read:  # tied: one tensor for both
            read[t.name] = read_tensor(t, dtype, device, location.scales.get(role), block)
    embeddings = read.get(location.tensors[EMBEDDINGS].name)
    norm_weight = read.get(location.tensors[FINAL_NORM].name)
    head_weight = read.get(location.tensors[LM_HEAD].name)
    lm_head = None
    if head_weight is not None:
        lm_head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False, device="meta")
        lm_head.weight = nn.Parameter(head_weight, requires_grad=False)
    norm = final_norm(config, norm_weight) if norm_weight is not None else None
    missing = len(location.missing_shards)
    source = f"{folder} (heads only: {', '.join(roles)} from {', '.join(location.head_shards)}" + (
        f"; {missing} of {len(location.shards)} shards absent)" if missing else ")"
    )
    return TargetHeads(config, embeddings, norm, lm_head, source)


def same_embeddings(copy: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a drafter's copy of its target's input embeddings (frozen in training) is `target`'s,
    compared at the lower precision of the two (a bf16 export of an fp32 target holds them rounded)."""
    if copy.shape != target.shape:
        return False
    low = copy.dtype if copy.element_size() <= target.element_size() else target.dtype
    return torch.equal(copy.to(low), target.to(low))


def heads_summary(h: TargetHeads) -> str:
    """e.g. "embeddings 163840x7168 bfloat16, lm_head tied: 2.35 GB", for the log."""
    parts, seen, total = [], set(), 0
    for role in HEAD_ROLES:
        module = {EMBEDDINGS: None, FINAL_NORM: h.final_norm, LM_HEAD: h.lm_head}[role]
        t = h.embeddings if role == EMBEDDINGS else getattr(module, "weight", None)
        if t is None:
            continue
        if role == LM_HEAD and h.embeddings is not None and t.data_ptr() == h.embeddings.data_ptr():
            parts.append("lm_head tied")
            continue
        if role != FINAL_NORM:
            parts.append(f"{role} {'x'.join(map(str, t.shape))} {str(t.dtype).removeprefix('torch.')}")
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return f"{', '.join(parts)}: {total / 1e9:.2f} GB"
