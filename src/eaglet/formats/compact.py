"""eaglet's compact layout (`eaglet extract --layout compact`, `eaglet convert --layout compact`):
`compact/rows_{a}-{b}/data_{i}.safetensors`, one per sample, with
- `input_ids` int32 [T], `loss_mask` uint8 [T];
- `aux_codes` uint8 [T, 3, 3H/4] and `aux_scales` fp16 [T, 3, H/32]: the three aux states in
  6-bit floating point (E3M2, the element type of the OCP MXFP6 format) with an fp16 scale per
  32 values, four codes packed in three bytes;
- `teacher_ids` int32 [T, K] and `teacher_log_probs` fp16 [T, K]: in place of the last state,
  the target's K most likely next tokens (full vocabulary, most likely first, so the first is
  the argmax) with their log-probabilities, log_softmax(lm_head(final_norm(h_N))).

data_config.json records "format": "eaglet-compact" and a "compact" section (version, scheme, K).
Since version 2 each file's header metadata holds a checksum of every tensor (see below).
Measured on SmolLM2 states: E3M2 with 32-value groups has 1.4 % relative RMS error (fp8 E4M3
with a scale per row: 1.0 %, at 8.06 bits instead of 6.5: the fp8 aux alone would be 0.375x of
v1's bytes, above the 0.35x this layout is for); see bench/compact.py for the training effect.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eaglet.formats.io import header_shapes, read_json, read_safetensors, write_safetensors_atomic
from eaglet.formats.samples import (
    AUX_CODES,
    DATA_CONFIG_FILE,
    EAGLE3_NUM_STATES,
    ROWS_PER_FOLDER,
    WRONG_DTYPE,
    WRONG_SHAPE,
    FileStates,
    Finding,
    StoredTeacher,
    TrainingSample,
    fmt_rows,
    keys_findings,
    lacks_keys,
    rows_folder,
)

log = logging.getLogger(__name__)

COMPACT_DIR = "compact"
COMPACT_VERSION = 2  # 2: every file carries a checksum of each of its tensors; 1: none
# Version-1 data is still read, with a warning (`eaglet check`: on data_config.json; training: once per
# dataset). Its files hold the same tensors in the same encoding, so they train exactly as before;
# refusing them would cost a re-extraction (GPU hours, when the source states were deleted for the
# space this layout saves) and leave the data no more correct. What it lacks is only the means to find
# damage, and the warning says how to get it. Writers always write the current version, and never
# into a version-1 folder (data_config.json's "compact" section must match to resume).
COMPACT_READ_VERSIONS = (1, COMPACT_VERSION)
COMPACT_UNCHECKED_VERSION = 1
# What recovers a damaged file (extract and convert resume: they write only the missing samples),
# and a dataset of files without checksums.
COMPACT_REWRITE_FILE = (
    "delete the file and re-run the `eaglet extract --layout compact` (or `eaglet convert --layout "
    "compact`) that made the dataset, into the same folder: it writes only the missing samples"
)
COMPACT_REWRITE_DATASET = (
    "to get files that can be checked, run `eaglet convert --layout compact` from the dataset "
    "it was made from (or `eaglet extract --layout compact`) into a new folder"
)
COMPACT_KEYS = ("input_ids", "loss_mask", "aux_codes", "aux_scales", "teacher_ids", "teacher_log_probs")
COMPACT_DTYPES = {
    "aux_codes": (torch.uint8,),
    "aux_scales": (torch.float16,),
    "teacher_ids": (torch.int32,),
    "teacher_log_probs": (torch.float16,),
    "loss_mask": (torch.uint8,),
    "input_ids": (torch.int32, torch.int64),
}
FP6_GROUP = 32  # values sharing one scale


# ---------------------------------------------------------------------------------------------
# The 6-bit codes
# ---------------------------------------------------------------------------------------------


def _fp6_e3m2_magnitudes() -> torch.Tensor:
    """The 32 non-negative E3M2 values (3 exponent bits, bias 3, 2 mantissa bits, subnormals), ascending."""
    mags = [(m / 4) * 2.0**-2 for m in range(4)]  # exponent field 0: subnormals 0, 0.0625, 0.125, 0.1875
    mags += [(1 + m / 4) * 2.0 ** (e - 3) for e in range(1, 8) for m in range(4)]
    return torch.tensor(mags)


FP6_MAGNITUDES = _fp6_e3m2_magnitudes()  # code & 31 indexes this; code & 32 is the sign
FP6_MAX = float(FP6_MAGNITUDES[-1])  # 28
FP6_VALUES = torch.cat([FP6_MAGNITUDES, -FP6_MAGNITUDES])  # decode table, indexed by the 6-bit code
_FP6_MIDPOINTS = (FP6_MAGNITUDES[1:] + FP6_MAGNITUDES[:-1]) / 2


def pack_6bit(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 64, last dim a multiple of 4 -> 3 bytes per 4 codes (little end first)."""
    c = codes.reshape(*codes.shape[:-1], -1, 4).to(torch.int32)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack_6bit(packed: torch.Tensor) -> torch.Tensor:
    b = packed.reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    out = torch.stack([word & 63, (word >> 6) & 63, (word >> 12) & 63, (word >> 18) & 63], dim=-1)
    return out.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def check_compact_hidden_size(hidden_size: int, where: str) -> None:
    """Refuse, before any work, a hidden size the compact layout's groups do not divide."""
    if hidden_size % FP6_GROUP:
        raise ValueError(
            f"{where}: hidden size {hidden_size} is not a multiple of {FP6_GROUP}, the compact layout's "
            "scale group; use --layout v1"
        )


def quantize_fp6(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (H a multiple of 32) -> (packed codes uint8 [..., 3H/4], scales fp16 [..., H/32]):
    each group of 32 scaled so its largest magnitude is E3M2's largest, rounded to the nearest value."""
    check_compact_hidden_size(x.shape[-1], "compact layout")
    g = x.float().reshape(*x.shape[:-1], -1, FP6_GROUP)
    if not torch.isfinite(g).all():
        raise ValueError("hidden states hold NaN/Inf (`eaglet check` on a v1 copy names the rows)")
    scale = (g.abs().amax(-1, keepdim=True) / FP6_MAX).to(torch.float16)
    if not torch.isfinite(scale).all():
        raise ValueError(f"hidden state values up to {float(g.abs().max()):.3g} overflow the fp16 scale")
    s = scale.float()
    mag = torch.bucketize((g / torch.where(s > 0, s, 1.0)).abs(), _FP6_MIDPOINTS)
    codes = (mag | ((g < 0).to(mag.dtype) << 5)).to(torch.uint8)
    return pack_6bit(codes.reshape(x.shape)), scale.squeeze(-1)


def dequantize_fp6(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = FP6_VALUES[unpack_6bit(packed).long()]
    g = values.reshape(*scales.shape, FP6_GROUP) * scales.float().unsqueeze(-1)
    return g.reshape(*scales.shape[:-1], -1).to(dtype)


def impossible_fp6_groups(
    packed: torch.Tensor, scales: torch.Tensor, values: torch.Tensor | None = None
) -> torch.Tensor:
    """[..., H/32] bool: the groups whose codes and scale `quantize_fp6` cannot have written
    (`values`: their `dequantize_fp6`, fp32, when the caller has it; else computed).

    The packing itself has no spare bits (four codes fill three bytes, and every one of the 64
    codes is written, 32 being -0), so no byte value, not even a row of 0xFF, is impossible on its
    own: the checksum finds those. What the encoder does guarantee: each group is scaled so that its
    largest magnitude becomes E3M2's largest (code 31 or 63, the value +-28 x the scale) - the fp16
    rounding of a normal scale moves it by < 0.1 %, the rounding boundary is 7 % lower; a zero scale
    (an all-zero group, or one below fp16's range) leaves only codes 0 and 32; and a scale is never
    negative. A subnormal scale rounds coarsely enough to miss code 31, so such groups are not judged."""
    s = scales.float()
    if values is None:
        values = dequantize_fp6(packed, scales)
    top = values.abs().reshape(*scales.shape, FP6_GROUP).amax(-1)  # exactly 28 x s where a code is 31 or 63
    bad = ((s >= torch.finfo(torch.float16).tiny) & (top != FP6_MAX * s)) | torch.signbit(s)
    zero = s == 0
    if zero.any():  # every value of such a group is 0 whatever its codes: look at the codes (few groups)
        codes = unpack_6bit(packed.reshape(*scales.shape, FP6_GROUP * 3 // 4)[zero])
        bad[zero] |= (codes & 31).amax(-1) != 0
    return bad


# ---------------------------------------------------------------------------------------------
# data_config.json's "compact" section
# ---------------------------------------------------------------------------------------------


def compact_config(top_k: int) -> dict[str, Any]:
    """data_config.json's "compact" section: what a reader needs to know the files' scheme."""
    return {"version": COMPACT_VERSION, "aux": f"fp6_e3m2, fp16 scale per {FP6_GROUP}", "teacher_top_k": top_k}


def compact_config_fields(top_k: int) -> dict[str, Any]:
    """What a compact dataset's data_config.json records about its scheme, beside the common fields."""
    return {"compact": compact_config(top_k)}


def compact_section(cfg: dict[str, Any] | None) -> dict[str, Any]:
    return (cfg or {}).get("compact") or {}


def compact_version_problem(cfg: dict[str, Any]) -> str | None:
    """Why data_config.json's compact section is not one this eaglet reads (None: it is)."""
    version = compact_section(cfg).get("version")
    if version in COMPACT_READ_VERSIONS:
        return None
    return (
        f"compact version {version!r}: this eaglet reads versions {', '.join(map(str, COMPACT_READ_VERSIONS))}; "
        "use the eaglet that wrote it, or write the dataset again with `eaglet convert --layout compact` "
        "(or `eaglet extract --layout compact`) into a new folder"
    )


def compact_version_warning(cfg: dict[str, Any]) -> str | None:
    """What a readable compact version lacks (None: nothing): version 1's files carry no checksum."""
    if compact_section(cfg).get("version") != COMPACT_UNCHECKED_VERSION:
        return None
    return (
        f"compact version {COMPACT_UNCHECKED_VERSION}, written before files carried checksums: a flipped bit or an "
        f"overwritten row in them cannot be found; {COMPACT_REWRITE_DATASET}"
    )


def compact_top_k(cfg: dict[str, Any]) -> Any:
    """The K of the stored teacher, as data_config.json records it."""
    return compact_section(cfg).get("teacher_top_k")


# ---------------------------------------------------------------------------------------------
# Checksums: a compact file's header metadata (read without its tensors) holds one entry,
# "sha256": a JSON object of each tensor's name and the hex sha256 of its bytes as stored. One entry,
# because safetensors writes several in no fixed order, and a sample written again must be the same
# bytes. So a flipped bit or an overwritten row in any tensor is found, and the tensor named, by
# `eaglet check` and by training's reader. sha256 rather than blake2b: with the SHA instructions of
# current x86 CPUs it hashes ~1.2 GB/s to blake2b's ~0.7. Measured on a 20 MB file (T 2048, H 4096):
# 17 ms, 2-3 % of training's reader, whose dequantization of the aux states takes ~35 ms per MB.
# ---------------------------------------------------------------------------------------------

COMPACT_CHECKSUM = "sha256"


@dataclass
class CompactFile:
    """A compact file's tensors and its header metadata (the checksums)."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as safetensors stores them (C order, little-endian), without a copy."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().data).hexdigest()


def compact_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The header metadata a compact file is written with: the digest of each of its tensors."""
    return {COMPACT_CHECKSUM: json.dumps({k: tensor_digest(t) for k, t in tensors.items()}, sort_keys=True)}


def has_compact_checksums(metadata: dict[str, str]) -> bool:
    return COMPACT_CHECKSUM in metadata


def compact_checksum_problems(f: CompactFile) -> list[str]:
    """Each tensor of `f` whose bytes do not match the checksum written with the file, in a phrase
    that names it ([]: all match)."""
    if not has_compact_checksums(f.metadata):
        return [
            f"no {COMPACT_CHECKSUM} checksums in its header (written before compact version {COMPACT_VERSION}, "
            "by another tool, or rewritten since)"
        ]
    try:
        digests = json.loads(f.metadata[COMPACT_CHECKSUM])
        if not isinstance(digests, dict):
            raise ValueError(f"a JSON {type(digests).__name__}")
    except (ValueError, RecursionError) as e:  # a flipped bit in the header's checksum text itself
        return [f"the {COMPACT_CHECKSUM} checksums in its header are not a JSON object of digests ({e})"]
    out = []
    for k, t in f.tensors.items():
        if k not in digests:
            out.append(f"{k} has no {COMPACT_CHECKSUM} in the header")
        elif tensor_digest(t) != digests[k]:
            out.append(
                f"{k}: its bytes do not match the {COMPACT_CHECKSUM} written with them, so they changed since "
                "(disk, copy or edit)"
            )
    return out


def compact_damage(f: CompactFile, cfg: dict[str, Any] | None) -> list[str]:
    """For `eaglet check`: each tensor whose bytes changed since the file was written, with what
    recovers it (a version-1 dataset's files carry no checksums: data_config.json's warning says so once)."""
    if compact_section(cfg).get("version") == COMPACT_UNCHECKED_VERSION and not has_compact_checksums(f.metadata):
        return []
    return [f"{why}; {COMPACT_REWRITE_FILE}" for why in compact_checksum_problems(f)]


@functools.lru_cache(maxsize=None)
def _warn_unchecked(root: str) -> None:
    log.warning("%s: %s", root, compact_version_warning({"compact": {"version": COMPACT_UNCHECKED_VERSION}}))


def _in_unchecked_dataset(path: str | os.PathLike) -> bool:
    """Whether a compact file is in a version-1 dataset, whose files carry no checksum (warned once
    per dataset). Read only for a file without checksums: every current file has them."""
    root = Path(path).parent.parent.parent  # root/compact/rows_{a}-{b}/data_{i}.safetensors
    try:
        cfg = read_json(root / DATA_CONFIG_FILE)
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict) or compact_section(cfg).get("version") != COMPACT_UNCHECKED_VERSION:
        return False
    _warn_unchecked(str(root))
    return True


def verify_compact_file(f: CompactFile, path: str | os.PathLike) -> None:
    """Refuse a compact file whose tensors do not match their checksums, naming them."""
    if not has_compact_checksums(f.metadata) and _in_unchecked_dataset(path):
        return
    damage = compact_checksum_problems(f)
    if damage:
        raise ValueError(f"{path}: {'; '.join(damage)}; {COMPACT_REWRITE_FILE}")


# ---------------------------------------------------------------------------------------------
# Files: writer, readers, schema
# ---------------------------------------------------------------------------------------------


def compact_relative_path(index: int, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    return f"{COMPACT_DIR}/{rows_folder(index, rows_per_folder)}/data_{index}.safetensors"


def write_compact_sample(
    out_dir: str | os.PathLike,
    index: int,
    input_ids: torch.Tensor,
    aux_states: list[torch.Tensor],
    loss_mask: torch.Tensor,
    teacher: StoredTeacher,
) -> Path:
    path = Path(out_dir) / compact_relative_path(index)
    if len(aux_states) != EAGLE3_NUM_STATES - 1:
        raise ValueError(f"{path}: {len(aux_states)} aux states, expected {EAGLE3_NUM_STATES - 1}")
    try:
        codes, scales = quantize_fp6(torch.stack(aux_states, dim=1))
    except ValueError as e:
        raise ValueError(f"{path} (sample {index}): {e}") from e
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "loss_mask": loss_mask.to(torch.uint8),
        "aux_codes": codes,
        "aux_scales": scales,
        "teacher_ids": teacher.ids.to(torch.int32),
        "teacher_log_probs": teacher.log_probs.to(torch.float16),
    }
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    return write_safetensors_atomic(path, tensors, metadata=compact_checksums(tensors))


def write_compact_states(
    out: str | os.PathLike,
    index: int,
    input_ids: torch.Tensor,
    states: list[torch.Tensor],
    loss_mask: torch.Tensor,
    teacher: StoredTeacher | None,
) -> Path:
    """One sample from all its states, as every layout's writer takes it: the aux states, and in
    place of the last state `teacher`, the target's top-K computed from it."""
    if teacher is None:
        raise ValueError(f"compact sample {index}: the layout stores the target's top-K in place of the last state")
    return write_compact_sample(out, index, input_ids, states[: EAGLE3_NUM_STATES - 1], loss_mask, teacher)


def read_compact_file(path: str | os.PathLike) -> CompactFile:
    tensors = read_safetensors(path)  # names a truncated or damaged file
    with safe_open(str(path), framework="pt") as h:  # the header again, without the tensors
        return CompactFile(tensors, h.metadata() or {})


def compact_fields(obj: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Refuse a compact file whose keys or shapes are not the layout's, naming the field."""
    missing = [k for k in COMPACT_KEYS if k not in obj]
    if missing:
        raise ValueError(f"{path}: keys {sorted(obj)}: missing {missing}")
    T = obj["input_ids"].shape[0]
    codes, scales, tids, tlp = (obj[k] for k in ("aux_codes", "aux_scales", "teacher_ids", "teacher_log_probs"))
    if (
        codes.dim() != 3
        or scales.dim() != 3
        or codes.shape[:2] != (T, 3)
        or scales.shape[:2] != (T, 3)
        or codes.shape[2] * 4 != scales.shape[2] * FP6_GROUP * 3
    ):
        raise ValueError(
            f"{path}: aux_codes {tuple(codes.shape)} and aux_scales {tuple(scales.shape)}: expected "
            f"[T, 3, 3H/4] and [T, 3, H/{FP6_GROUP}] with T = {T}"
        )
    if tids.dim() != 2 or tids.shape != tlp.shape or tids.shape[0] != T or obj["loss_mask"].shape != (T,):
        raise ValueError(
            f"{path}: teacher_ids {tuple(tids.shape)}, teacher_log_probs {tuple(tlp.shape)}, loss_mask "
            f"{tuple(obj['loss_mask'].shape)}: expected [T, K], [T, K] and [T] with T = {T}"
        )


def compact_training_sample(path: str | os.PathLike) -> TrainingSample:
    f = read_compact_file(path)
    obj = f.tensors
    compact_fields(obj, path)
    verify_compact_file(f, path)  # ~0.8 ms per MB: 2-3 % of this reader (see COMPACT_CHECKSUM)
    aux = dequantize_fp6(obj["aux_codes"], obj["aux_scales"])  # [T, 3, H]
    return TrainingSample(
        obj["input_ids"].long(),
        aux.reshape(aux.shape[0], -1),
        None,
        obj["loss_mask"].long(),
        StoredTeacher(obj["teacher_ids"], obj["teacher_log_probs"]),
    )


def compact_tokens(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask), read by name without the other tensors."""
    with safe_open(str(path), framework="pt") as h:
        return h.get_tensor("input_ids").long(), h.get_tensor("loss_mask").long()


def compact_stored_shapes(path: str | os.PathLike) -> tuple[list[tuple[int, ...]], int]:
    """(the lengths of its per-token tensors, its states: the aux ones plus the stored teacher in
    place of the last one), from the header."""
    shapes = header_shapes(path, COMPACT_KEYS)
    codes = shapes["aux_codes"]
    lengths = [tuple(shapes["input_ids"]), *(tuple(shape[:1]) for shape in shapes.values())]
    return lengths, (codes[1] + 1) if len(codes) == 3 else -1


def impossible_codes_finding(codes: torch.Tensor, scales: torch.Tensor, aux: torch.Tensor) -> Finding | None:
    """The aux groups [T, 3, H/32] whose codes and scale the encoder cannot have written, by row
    (`aux`: the states they dequantize to)."""
    bad = impossible_fp6_groups(codes, scales, aux)
    if not bad.any():
        return None
    t, s, g = (int(i) for i in bad.nonzero()[0])
    n, scale = FP6_GROUP, float(scales[t, s, g])
    top = int((unpack_6bit(codes[t, s]) & 31).reshape(-1, n)[g].max())
    why = (
        "a negative scale, which the encoder never writes"
        if math.copysign(1.0, scale) < 0
        else f"scale 0 with codes up to magnitude {top}, but at scale 0 the encoder writes only +-0"
        if scale == 0
        else f"largest code magnitude {top} at scale {scale:.3g}, but the encoder stores each group's largest value "
        "as 31 (E3M2's largest)"
    )
    rows = bad.flatten(1).any(1).nonzero().flatten().tolist()
    return Finding(
        AUX_CODES,
        f"aux row {t}, state {s}, values {g * n}..{(g + 1) * n - 1}: {why} "
        f"({int(bad.sum())} such groups, rows {fmt_rows(rows)}); " + COMPACT_REWRITE_FILE,
    )


def compact_file_states(f: CompactFile, where: str) -> tuple[FileStates | None, list[Finding]]:
    """For `eaglet check`: the dequantized aux states and the stored teacher, after the layout's
    keys, dtypes and shapes and its codes' invariants."""
    obj = f.tensors
    found = keys_findings(obj, COMPACT_KEYS)
    if found and lacks_keys(obj, COMPACT_KEYS):
        return None, found
    bad = [f"{k} is {obj[k].dtype}" for k, ok in COMPACT_DTYPES.items() if obj[k].dtype not in ok]
    if bad:
        return None, found + [
            Finding(
                WRONG_DTYPE,
                f"{', '.join(bad)}: expected "
                + ", ".join(
                    f"{k} {'/'.join(str(d).removeprefix('torch.') for d in ok)}" for k, ok in COMPACT_DTYPES.items()
                ),
            )
        ]
    try:
        compact_fields(obj, where)
    except ValueError as e:
        return None, found + [Finding(WRONG_SHAPE, str(e).removeprefix(f"{where}: "))]
    aux = dequantize_fp6(obj["aux_codes"], obj["aux_scales"])
    found += [q for q in [impossible_codes_finding(obj["aux_codes"], obj["aux_scales"], aux)] if q]
    teacher = StoredTeacher(obj["teacher_ids"], obj["teacher_log_probs"])
    return FileStates(obj["input_ids"], obj["loss_mask"], list(aux.unbind(1)), teacher), found
