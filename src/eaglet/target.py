"""The target model: resolve `--target`, load it and its tokenizer, find its layers.

`--target` is a Hugging Face model folder or hub id. Without it, eaglet uses the embedded
SmolLM2-135M-Instruct: its GGUF file is loaded once with transformers (~20 s) and cached as
a plain safetensors model folder under `$EAGLET_HOME`, so later loads take well under a second.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors import SafetensorError
from torch import nn

from eaglet import embedded, formats, heads, placement
from eaglet.layers import config_positions
from eaglet.options import env_switch
from eaglet.formats import TokenizedSample
from eaglet.formats.io import REDO
from eaglet.heads import TargetHeads
from eaglet.placement import Device, Placement

if TYPE_CHECKING:  # transformers' modelling code loads only with a model
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


AUTO = "auto"
# Overrides what the CPU's instructions say about bf16 speed: "1" (treat bf16 as fast, so `auto`
# is bf16), "0" (slow: `auto` is fp32). The test suite sets it so that no result depends on the
# machine it runs on; a user can set it to pin `auto` across machines of both kinds.
FAST_BF16_ENV = "EAGLET_CPU_FAST_BF16"


def cpu_fast_bf16_override() -> bool | None:
    """EAGLET_CPU_FAST_BF16 as a bool, or None when unset; any other value is refused."""
    return env_switch(FAST_BF16_ENV, "auto = bf16 on CPU", "auto = fp32")


def cpu_description() -> str:
    """The CPU's model name and matrix ISA, e.g. "AMD EPYC (AVX512-BF16)": what `--dtype auto`
    and every speed figure depend on, so results record it."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
        platform.processor() or "unknown CPU",
    )
    isa = (
        "AMX bf16"
        if "amx_bf16" in info
        else "AVX512-BF16"
        if "avx512_bf16" in info
        else "AVX2"
        if "avx2" in info
        else "unknown ISA"
    )
    return f"{model} ({isa})"


def fast_bf16(device: torch.device | str | None = None) -> bool:
    """Whether bf16 matrix products run at least as fast as fp32 on `device`: on CUDA when it
    supports bf16; on a CPU only with bf16 matrix instructions (AMX or AVX512-BF16). Without
    them PyTorch emulates bf16 products, 10-100x slower than fp32 (an AVX2-only CPU: ~1 vs ~50
    GFLOP/s per core), so compute-bound work (prefill, batched generation, training) must run
    in fp32 there. On a CPU, EAGLET_CPU_FAST_BF16 (0 or 1) overrides the detection."""
    device = torch.device(device) if device is not None else pick_device(None)
    override = cpu_fast_bf16_override() if device.type == "cpu" else None
    if override is not None:
        return override
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(cpu, name, lambda: False)() for name in checks)
    return False


def parse_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype:
    """A dtype by name; 'auto' is bf16 where the device computes it fast (see `fast_bf16`), else fp32."""
    if name.lower() == AUTO:
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(set(DTYPES)) + [AUTO]}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class TargetRef:
    """Where a target's weights and tokenizer come from, and how to name it in records."""

    path: str  # a local folder or a hub id, as from_pretrained takes it
    name: str  # what data_config.json calls it
    revision: str  # a local folder's identity (`heads.heads_identity`), or the hub commit

    def is_revision(self, recorded: str | None) -> bool:
        """Whether `recorded` (a revision a dataset, run or drafter records) names this target: its
        identity, or for a local folder the whole-folder hash eaglet recorded before it had one."""
        return recorded == self.revision or (
            Path(self.path).is_dir() and recorded == whole_folder_fingerprint(Path(self.path))
        )


def embedded_cache_dir() -> Path:
    return embedded.eaglet_home() / "models" / f"{embedded.SMOLLM2_NAME}-{embedded.smollm2_version()}"


def ensure_embedded_target() -> Path:
    """Return the cached safetensors folder of the embedded SmolLM2, building it if needed."""
    final = embedded_cache_dir()
    if (final / "config.json").exists():
        return final
    gguf = embedded.smollm2_gguf()
    return cache_gguf_model(gguf, final, f"{embedded.SMOLLM2_DIST}=={embedded.smollm2_version()} {gguf.name}")


def cache_gguf_model(gguf: Path, final: Path, source: str) -> Path:
    """Load a GGUF model file with transformers (dequantized, fp32) and save it, tokenizer
    included, as a safetensors model folder at `final`, which later loads in well under a second.

    The folder is built under a temp name and renamed into place, so a folder at the final
    path is always complete; a killed build leaves only a temp folder that is never used.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds to import: only where a target is read

    log.info("caching %s as a safetensors folder (one time, ~20 s)", gguf)
    t0 = time.time()
    formats.read_gguf(gguf)  # a damaged file named here, in eaglet's words, not deep in transformers' reader
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # fp32 keeps the dequantized values exact; callers cast to the dtype they want.
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # save_pretrained refuses a GGUF-quantized model: copy the (dequantized) weights into a
    # fresh model whose config has no quantization_config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(quantized.state_dict())
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "EAGLET_SOURCE").write_text(source + "\n")
        if final.exists() and not (final / "config.json").exists():
            shutil.rmtree(final)  # not ours: our folders only appear complete, by rename
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached %s in %s (%.1f s)", gguf.name, final, time.time() - t0)
    return final


def folder_fingerprint(folder: Path) -> str:
    """A local target's identity: its config, tokenizer and heads (`heads.heads_identity`), so a
    download of only the shards that hold the heads is the same target as the full folder. A
    checkpoint whose heads eaglet cannot locate or read (no safetensors, an unknown layout, a
    quantized head) is identified by the whole folder instead."""
    try:
        location = heads.locate_heads(folder)
    except ValueError:  # HeadsNotFound is one; so is a quantized head
        return whole_folder_fingerprint(folder)
    return heads.heads_identity(location)


@functools.lru_cache(maxsize=8)
def whole_folder_fingerprint(folder: Path) -> str:
    """A content hash of a model folder: config, tokenizer files, and each weight file's
    name, size and first MiB (hashing every byte of a 100 GB model would take minutes)."""
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def embedded_name() -> str:
    return f"{embedded.SMOLLM2_NAME} ({embedded.SMOLLM2_DIST}=={embedded.smollm2_version()})"


def is_embedded(spec: str | None) -> bool:
    """No target, the embedded default's record name, or its cache folder."""
    if not spec or spec == embedded_name():
        return True
    try:
        return Path(spec).resolve() == embedded_cache_dir().resolve()
    except (OSError, FileNotFoundError):  # no wheel installed: cannot be the embedded default
        return False


def find_target_gguf(given: str | Path | None, target: str | None, why: str) -> Path:
    """The target's GGUF file (llama.cpp's copy of the target): the one given, or the embedded
    SmolLM2's own GGUF for the embedded target; `why` says what needs it, for the error."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"--target-gguf {given}: no such file")
        formats.read_gguf(path)  # a cut-off or damaged file is named here, not left to the engine's own words
        return path
    if is_embedded(target):
        return embedded.smollm2_gguf()
    raise ValueError(
        f"the target is {target}, not the embedded one; pass --target-gguf with the target's GGUF file ({why})"
    )


def target_vocabulary(target: str | None) -> list[str | None] | None:
    """The target's tokens by id (None past its tokenizer), to compare with a GGUF's; None when
    the target cannot be read here (a hub id not in the cache), said in the log. A hub id is read
    from the cache only: a check is no reason to reach the network."""
    from transformers import AutoTokenizer  # seconds to import: only where a target is read

    try:
        if is_embedded(target) or Path(str(target)).is_dir():
            tokenizer = load_tokenizer(resolve_target(target))
        else:
            tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        log.warning(
            "the target %s cannot be read here (%s): its GGUF's tokens are not compared with its tokenizer's", target, e
        )
        return None
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))


def file_fingerprint(path: Path) -> str:
    """A content hash of one file: its size and first and last MiB (enough to tell two GGUFs
    apart without reading gigabytes)."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()[:16]


def f32_target_gguf(source: Path) -> Path:
    """`source` with its weights in f32 (itself if they already are plain floats), cached under
    $EAGLET_HOME/gguf once: for the embedded target, the very weights eaglet's own target has. The
    copy is written atomically (a kill leaves no copy, never part of one); a cached copy that is not
    a whole GGUF all the same (a disk fault, a partial copy of $EAGLET_HOME) is written again."""
    if not formats.is_quantized(source):  # reads `source` whole: a damaged one is refused here, by name
        return source
    cached = embedded.eaglet_home() / "gguf" / f"{source.stem}-{file_fingerprint(source)}.f32{source.suffix}"
    if cached.is_file():
        try:
            formats.read_gguf(cached)
            return cached
        except formats.GGUFDamaged as e:  # reused as it is, it would fail every later run the same way
            log.warning("%s: %s; writing it again from %s", cached, e.what, source)
    log.info("writing %s dequantized to f32 (%s, once)", source.name, cached)
    formats.write_gguf_as(source, cached, "F32")
    return cached


def serving_name(spec: str | None) -> str | None:
    """The name a serving engine loads the target by: the hub id the embedded GGUF was made
    from, else the spec itself."""
    return embedded.SMOLLM2_HUB_ID if is_embedded(spec) else spec


def target_source(given: str | None, recorded_where: str) -> str:
    """What a message calls the target spec: the option when one was given, else the file field it
    was read from (a recorded path that no longer exists is no fault of the command line)."""
    return "--target" if given is not None else recorded_where


def refuse_shards_elsewhere(folder: Path, named: str) -> None:
    """A target folder's weight index names shards inside the folder only: one that leads out
    (`../x.safetensors`, an absolute path) would have the target's weights read from elsewhere. A
    shard that is a link is the folder owner's (a Hugging Face cache snapshot links its files).
    `named`: how the command named the target ("--target org/model"), for the message."""
    index = folder / heads.INDEX_FILE
    if index.is_file():
        for shard in set(formats.read_weight_index(index).values()):
            try:
                formats.inside_folder(folder, shard, f"{index}: a shard", follow_links=False)
            except ValueError as e:
                raise ValueError(f"{named}: {e}") from e


def resolve_target(spec: str | None, source: str = "--target") -> TargetRef:
    """The target `spec` names (None: the embedded default); `source` says where the spec was given
    or read, for messages."""
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"{source}: {spec!r} is not a model folder or hub id")
    if not spec or spec == embedded_name():
        folder = ensure_embedded_target()
        return TargetRef(str(folder), embedded_name(), folder_fingerprint(folder))
    if Path(spec).is_dir():
        folder = Path(spec).resolve()
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{source} {spec}: folder has no config.json; not a Hugging Face model folder")
        config = formats.read_json(folder / "config.json")  # a damaged one is named here, not deep in transformers
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f'{folder / "config.json"}: no "model_type"; not a Hugging Face model config')
        refuse_shards_elsewhere(folder, f"{source} {spec}")
        return TargetRef(str(folder), str(folder), folder_fingerprint(folder))
    from transformers import AutoConfig  # seconds to import: only where a target is read

    try:
        config = AutoConfig.from_pretrained(spec, trust_remote_code=heads.trust_remote_code())
    except OSError as e:
        raise FileNotFoundError(
            f"{source} {spec}: not a local folder, and the hub id could not be resolved: {e}"
        ) from e
    refuse_hub_shards_elsewhere(spec, source)
    return TargetRef(spec, spec, getattr(config, "_commit_hash", None) or "unknown")


def refuse_hub_shards_elsewhere(spec: str, source: str) -> None:
    """`refuse_shards_elsewhere` for a hub id, on its snapshot in the Hugging Face cache (where the
    weights will be read from): huggingface_hub would refuse a `../` shard later, in its own words,
    naming neither the index nor the option."""
    from transformers.utils import cached_file  # seconds to import: only where a hub id is resolved

    index = cached_file(
        spec,
        heads.INDEX_FILE,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )
    if index is not None:  # None: a single-file model, or an index not fetched yet
        refuse_shards_elsewhere(Path(index).parent, f"{source} {spec}")


# ---------------------------------------------------------------------------------------------
# The target's config, read without its weights (positions: `layers.config_positions`)
# ---------------------------------------------------------------------------------------------


def text_config(ref: TargetRef) -> Any:
    """The target's config (its text model's, for a multimodal one), read without the weights."""
    if Path(ref.path).is_dir():
        return heads.text_config(ref.path)
    from transformers import AutoConfig  # seconds to import: only where a target is read

    return from_pretrained(AutoConfig, ref).get_text_config()


def max_positions(model: PreTrainedModel | TargetHeads) -> int:
    """How many positions a loaded target holds (`config_positions` of its config)."""
    return config_positions(model.config)


def config_where(ref: TargetRef) -> str:
    """Where the target's config lives, for a message."""
    folder = Path(ref.path)
    return str(folder / "config.json") if folder.is_dir() else f"the config.json of {ref.name}"


def prepared_target(prepared: str | Path, pconfig: dict[str, Any], target: str | None) -> TargetRef:
    """The target `prepared` was tokenized with (`target`, else the recorded one); refuse another."""
    ref = resolve_target(
        target if target is not None else pconfig.get("target_spec"),
        target_source(target, f"{Path(prepared) / formats.PREPARE_CONFIG_FILE} target_spec"),
    )
    if not ref.is_revision(pconfig["target_revision"]):
        raise ValueError(
            f"target {ref.name} (revision {ref.revision}) is not the one {prepared} was tokenized with "
            f"({pconfig['target']}, revision {pconfig['target_revision']})"
        )
    return ref


def from_pretrained(kind: Any, ref: TargetRef, **kwargs: Any) -> Any:
    """`kind.from_pretrained(ref.path)` without the folder's own code unless it was allowed
    (`heads.trust_remote_code`); a target that needs code, or has a model type transformers does not
    know, is refused saying so."""
    try:
        return kind.from_pretrained(ref.path, trust_remote_code=heads.trust_remote_code(), **kwargs)
    except SafetensorError as e:  # a truncated or damaged weight file: name it, not the Rust reader's words
        raise heads.damaged_weights(Path(ref.path), e) from e
    except pickle.UnpicklingError as e:  # a .bin transformers loaded weights-only: torch's words name no file
        if "Weights only load failed" not in str(e):
            raise
        bins = sorted(p.name for p in Path(ref.path).glob("*.bin")) if Path(ref.path).is_dir() else []
        raise formats.weights_only_refusal(f"target {ref.name}: {', '.join(bins) or 'a .bin weight file'}", e) from None
    except (ValueError, KeyError, TypeError) as e:
        text = str(e)
        if isinstance(e, json.JSONDecodeError):  # its message names neither the file nor the folder
            raise ValueError(
                f"target {ref.name}: {damaged_json(Path(ref.path)) or 'a JSON file'} is damaged ({text}); {REDO}"
            ) from None
        if "trust_remote_code" in text or "custom code" in text:
            raise ValueError(
                f"target {ref.name}: its {kind.__name__} needs the model folder's own code (auto_map); "
                f"{heads.REMOTE_CODE_HINT}"
            ) from None
        kinds = heads.text_config_dict(Path(ref.path)).get("model_type") if Path(ref.path).is_dir() else None
        if kinds and ("model_type" in text or "Unrecognized" in text or "does not recognize" in text):
            missing = (
                "its own code (auto_map) gives no class for it"
                if heads.trust_remote_code()
                else "eaglet ran no code from the model folder to learn it: with an auto_map that provides it, "
                "pass --trust-remote-code"
            )
            raise ValueError(
                f"target {ref.name}: model_type {kinds!r} is not one transformers knows to load as "
                f"{kind.__name__}; {missing}; else use a transformers release that knows {kinds!r} "
                f"({type(e).__name__}: {text[:160]})"
            ) from None
        raise


def damaged_json(folder: Path) -> Path | None:
    """The first JSON file of a model folder that does not parse, if any."""
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError, RecursionError):
            return path
    return None


def load_tokenizer(ref: TargetRef):
    from transformers import AutoTokenizer  # seconds to import: only where a target is read

    try:
        tokenizer = from_pretrained(AutoTokenizer, ref)
    except ValueError as e:
        if "backend tokenizer" not in str(e):
            raise
        # transformers names neither the folder nor the file it looked for
        raise ValueError(
            f"target {ref.name}: its tokenizer cannot be built (no readable tokenizer.json in {ref.path}, nor the "
            "files a tokenizer is converted from); copy the target's tokenizer files into the folder"
        ) from e
    if not tokenizer.is_fast:
        raise ValueError(f"target {ref.name}: eaglet needs a fast tokenizer (character offsets for the loss mask)")
    return tokenizer


def load_chat_tokenizer(ref: TargetRef):
    """The target's tokenizer, refused without a chat template: every stage that renders chats needs one."""
    tokenizer = load_tokenizer(ref)
    if not tokenizer.chat_template:
        raise ValueError(f"target {ref.name}: tokenizer has no chat template")
    return tokenizer


def load_target(
    ref: TargetRef, dtype: torch.dtype, device: torch.device, placed: Placement | None = None
) -> PreTrainedModel:
    """The target in eval mode without gradients: on `device`, or with `placed` across the devices
    of its device map (accelerate hooks move each layer's inputs to it; "disk" layers are read
    from the offload folder for each forward), refused before loading when it cannot fit."""
    from transformers import AutoModelForCausalLM  # seconds to import: only where a target is read

    t0 = time.time()
    if placed is None:
        model = from_pretrained(AutoModelForCausalLM, ref, dtype=dtype).to(device)
        where = str(device)
    else:
        device_map, folder = plan_device_map(ref, dtype, placed)
        model = from_pretrained(AutoModelForCausalLM, ref, dtype=dtype, device_map=device_map, offload_folder=folder)
        where = f"{placed.source}: " + ", ".join(
            f"{placement.device_name(d)} {n}" for d, n in module_counts(device_map).items()
        )
    model.eval().requires_grad_(False)
    log.info("loaded target %s (%s, %s) in %.2f s", ref.name, dtype_name(dtype), where, time.time() - t0)
    return model


def module_counts(device_map: dict[str, Device]) -> dict[Device, int]:
    """How many of the map's entries each device holds (for the log line)."""
    counts: dict[Device, int] = {}
    for dev in device_map.values():
        counts[dev] = counts.get(dev, 0) + 1
    return counts


def empty_target(ref: TargetRef, dtype: torch.dtype) -> PreTrainedModel:
    """The target's modules with weights of `dtype` on the meta device: sizes and names, no bytes."""
    from accelerate import init_empty_weights  # seconds to import: only where a target is placed
    from transformers import AutoConfig, AutoModelForCausalLM  # seconds to import: only where a target is read

    config = from_pretrained(AutoConfig, ref)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # a tied LM head is the embeddings' tensor: counted, and placed, once
    return model


def module_children(model: PreTrainedModel) -> dict[str, list[str]]:
    """Each module's name -> the names of its direct submodules and tensors (to split a map's key)."""

    def full(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    return {
        prefix: [full(prefix, n) for n, _ in module.named_children()]
        + [full(prefix, n) for n, _ in module.named_parameters(recurse=False)]
        + [full(prefix, n) for n, _ in module.named_buffers(recurse=False)]
        for prefix, module in model.named_modules()
    }


def read_pieces(model: PreTrainedModel) -> dict[str, str]:
    """{module name: what it is} of the modules whose weights eaglet reads itself, outside forward."""
    wanted = {
        id(model.get_input_embeddings()): "the input embeddings",
        id(model.get_output_embeddings()): "the LM head",
        id(getattr(base_model(model), "norm", None)): "the final norm",
    }
    return {name: wanted[id(m)] for name, m in model.named_modules() if id(m) in wanted}


def tensor_bytes(model: PreTrainedModel) -> dict[str, int]:
    """Bytes of each parameter and buffer, a tied weight counted once (under its first name)."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            sizes[name] = t.numel() * t.element_size()
    return sizes


def strategy_device_map(model: PreTrainedModel, placed: Placement) -> dict[str, Device]:
    """The map `from_pretrained(device_map=<strategy>)` would make, made here so it can be checked
    and its disk entries known before loading (transformers' own resolution, the same limits)."""
    from transformers.integrations.accelerate import _get_device_map  # seconds to import: only where placed

    return dict(_get_device_map(model, placed.strategy, available_memory(placed), None))


def available_memory(placed: Placement) -> dict[Device, int]:
    """Bytes each device may hold: --max-memory where given, else what is free now (GPU memory,
    the CPU's available RAM)."""
    from accelerate.utils import get_max_memory  # seconds to import: only where a target is placed

    measured = {k: int(v) for k, v in get_max_memory().items() if k != "disk"}
    return {**measured, **(placed.max_memory or {})}


def offload_folder(placed: Placement, device_map: dict[str, Device]) -> str | None:
    """Where "disk" weights go: --offload-folder, else a temporary folder removed at exit; None
    when nothing is offloaded."""
    if placement.DISK not in device_map.values():
        return None
    if placed.offload_folder:
        Path(placed.offload_folder).mkdir(parents=True, exist_ok=True)
        return placed.offload_folder
    folder = tempfile.mkdtemp(prefix="eaglet-offload-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def plan_device_map(ref: TargetRef, dtype: torch.dtype, placed: Placement) -> tuple[dict[str, Device], str | None]:
    """(the per-module device map, the offload folder) for loading `ref` as `placed` asks, checked
    on a weightless copy: every tensor placed, the weights eaglet reads never on disk, and the
    bytes on each device (disk: the offload folder's free space) within what it has."""
    model = empty_target(ref, dtype)
    pieces = read_pieces(model)
    if placed.strategy:
        device_map = placement.pieces_to_cpu(strategy_device_map(model, placed), pieces, module_children(model))
    else:
        assert isinstance(placed.device_map, dict)  # no strategy: a map of its own
        device_map = dict(placed.device_map)
        names = (
            {n for n, _ in model.named_modules()}
            | {n for n, _ in model.named_parameters()}
            | {n for n, _ in model.named_buffers()}
        )
        unknown = placement.unknown_keys(device_map, names)
        missing = placement.unplaced(sorted(tensor_bytes(model)), device_map)
        if unknown or missing:
            raise ValueError(
                f"{placed.source}: "
                + "; ".join(
                    ([f"names no module of {ref.name}: {', '.join(unknown[:5])}"] if unknown else [])
                    + (
                        [
                            f"places none of {len(missing)} tensors, e.g. {', '.join(missing[:5])} (name their modules, "
                            'or "" for the rest)'
                        ]
                        if missing
                        else []
                    )
                )
            )
    on_disk = placement.pieces_on_disk(device_map, pieces)
    if on_disk:
        raise ValueError(
            f"{placed.source}: puts {', '.join(on_disk)} on disk; eaglet reads those "
            "weights itself (the drafter's embeddings, the teacher's norm and head), so place them on a "
            'GPU or "cpu"'
        )
    folder = offload_folder(placed, device_map)
    available = available_memory(placed)
    if folder is not None:
        available[placement.DISK] = shutil.disk_usage(folder).free
    needed = placement.bytes_per_device(device_map, tensor_bytes(model))
    placement.refuse_unfit(placed, needed, available, torch.cuda.device_count(), ref.name)
    return device_map, folder


def input_device(model: PreTrainedModel) -> torch.device:
    """Where a forward's input ids go: the device the input embeddings run on. Under a device map
    that is their accelerate hook's execution device (their weights may be offloaded); for a
    target on one device, its device. Not `model.device`, which is the first parameter's."""
    embeddings = model.get_input_embeddings()
    hooked = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if hooked is not None:
        return torch.device(f"cuda:{hooked}" if isinstance(hooked, int) else hooked)
    return embedding_weight(model).device


# ---------------------------------------------------------------------------------------------
# The target's heads: read alone (`eaglet.heads`), or a loaded model's
# ---------------------------------------------------------------------------------------------

# Train runs the layer-identity recompute itself only for a whole target this small on disk (it
# loads every layer for it); a larger one is `eaglet check DATA --target T`'s job.
LAYER_CHECK_MAX_BYTES = 2 << 30


def heads_of_model(model: PreTrainedModel) -> TargetHeads:
    """The heads of a target already loaded (online training, extract): the model's own modules."""
    inner = base_model(model)
    norm = next((getattr(inner, n) for n in ("norm", "final_layernorm", "ln_f") if hasattr(inner, n)), None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(model).__name__}")
    return TargetHeads(
        model.config, embedding_weight(model).detach(), norm, model.get_output_embeddings(), type(model).__name__
    )


def load_heads(
    ref: TargetRef,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    roles: tuple[str, ...] = heads.HEAD_ROLES,
) -> TargetHeads:
    """The target's embeddings, final norm and LM head in `dtype` (None: as stored) on `device`,
    read alone from a local folder's safetensors (`heads.read_heads`: the folder may hold only the
    shards with them). A hub id, or a checkpoint whose heads the reader cannot place, is loaded
    whole (in `dtype`, fp32 when None) and its heads taken."""
    folder = Path(ref.path)
    if folder.is_dir():
        try:
            return heads.read_heads(folder, dtype, device, roles)
        except heads.HeadsNotFound as e:
            log.info("%s: the heads cannot be read alone (%s); loading the whole target", ref.name, e)
    return heads_of_model(load_target(ref, dtype or torch.float32, torch.device(device)))


def whole_target_size(ref: TargetRef) -> int | None:
    """The bytes of a local target's weight files when every one is present, else None (a
    head-only folder, or a hub id)."""
    folder = Path(ref.path)
    if not folder.is_dir():
        return None
    try:
        location = heads.locate_heads(folder)
    except ValueError:  # no safetensors the reader knows: the weight files it has are all there is
        return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))
    if location.missing_shards:
        return None
    return sum((folder / s).stat().st_size for s in location.shards)


def base_model(model: PreTrainedModel) -> PreTrainedModel:
    """The decoder stack without the LM head (running the head would only waste time): by
    transformers' contract a model of the same family, under its `base_model_prefix`."""
    base = getattr(model, "base_model_prefix", None)
    inner = getattr(model, base, None) if base else None
    return cast("PreTrainedModel", inner) if isinstance(inner, nn.Module) else model


def embedding_weight(model: PreTrainedModel) -> torch.Tensor:
    """The input embeddings' table (its device: where the ids go, unless offloaded)."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The target's list of decoder layers, found without knowing the architecture's names."""
    n = model.config.num_hidden_layers
    inner = base_model(model)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n:
        return layers
    for _, module in inner.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def generation_config(
    temperature: float, top_p: float, max_new_tokens: int, pad_id: int, eos_ids: list[int], **extra: Any
):
    """A complete GenerationConfig for `generate`. `generate` fills every unset field from the
    model's own generation_config.json, and checkpoints ship sampling defaults there (Qwen:
    top_k 20, repetition_penalty 1.05). Those would silently change what temperature/top_p mean
    and bend greedy output: this one replaces it, so only these settings and transformers'
    neutral globals apply."""
    from transformers import GenerationConfig  # seconds to import: only where a target is read

    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    return GenerationConfig(
        **sampling,
        repetition_penalty=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=list(eos_ids),
        use_cache=True,
        **extra,
    )


# ---------------------------------------------------------------------------------------------
# Running the target: captured layer outputs of a padded batch (extract, online training, decoding)
# ---------------------------------------------------------------------------------------------


class LayerCapture:
    """Forward hooks that keep a reference to the output of chosen decoder layers."""

    def __init__(self, layers: nn.ModuleList, layer_ids: list[int]):
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [layers[k - 1].register_forward_hook(self._hook(k)) for k in layer_ids]
        self.layer_ids = layer_ids

    def _hook(self, layer_id: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """The captured outputs in layer-id order, moved to `device` when given (under a device
        map each comes from its own layer's device)."""
        missing = [k for k in self.layer_ids if k not in self.outputs]
        if missing:
            raise RuntimeError(f"layer ids {missing} produced no output in the forward pass")
        states = [self.outputs[k] if device is None else self.outputs[k].to(device) for k in self.layer_ids]
        self.outputs.clear()
        return states

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def pad_right(batch: list[TokenizedSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, longest], padded on the right with 0 / mask 0."""
    longest = max(len(s.input_ids) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    attn = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[row, : len(s.input_ids)] = 1
    return ids, attn


@torch.inference_mode()
def run_batch(
    model: PreTrainedModel,
    capture: LayerCapture,
    batch: list[TokenizedSample],
    device: torch.device,
    store_dtype: torch.dtype,
    out_device: torch.device | str = "cpu",
) -> list[list[torch.Tensor]]:
    """One padded forward; per sample, the captured states cut to its length, on `out_device`
    (CPU for writing files; the compute device when `eaglet train --online` consumes them). The
    inputs go to `device`, or where the embeddings run (`input_device`) when a device map placed
    the target."""
    ids, attn = pad_right(batch)
    first = input_device(model) if hasattr(model, "hf_device_map") else device
    base_model(model)(input_ids=ids.to(first), attention_mask=attn.to(first), use_cache=False)
    states = [h.to(out_device, store_dtype) for h in capture.take()]
    # .clone(): each stored tensor must own its storage, or torch.save writes the whole batch.
    return [[h[row, : len(s.input_ids)].clone() for h in states] for row, s in enumerate(batch)]
