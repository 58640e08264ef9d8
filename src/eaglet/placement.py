"""Where a target too large for one device lives: `--device-map`, `--max-memory`, `--offload-folder`.

Every stage that runs the target (extract, regen, train --online, check, eval) takes the same
three options; this module reads and checks them (no torch here: a wrong value is refused
before anything heavy loads) and judges whether a planned placement fits, from plain numbers.
`target.load_target` turns a `Placement` into a per-module device map (accelerate's, the one
`from_pretrained(device_map=...)` takes) on an empty, weightless model and loads with it.

A device map names, per module, a CUDA device (0, "cuda:1"), "cpu" (weights in RAM, computed
there or moved to the GPU layer by layer) or "disk" (weights read for each forward: memory-mapped
from the checkpoint's own safetensors files, or, for weights that loading converts, such as
DeepSeek-V3's experts merged into one tensor per layer, from copies written to the offload
folder). The strategies auto / balanced / sequential are accelerate's: fill the GPUs (evenly, or
in order), then the CPU, then disk.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from eaglet.options import DEVICE_MAP_STRATEGIES

Device = Union[int, str]  # a CUDA index, "cpu" or "disk" (accelerate's names)
CPU, DISK = "cpu", "disk"
UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class Placement:
    """A checked `--device-map` (a strategy name or {module name: device}) with its memory limits
    per device (bytes; devices not named are measured) and the folder for "disk" weights."""

    device_map: str | dict[str, Device]
    max_memory: dict[Device, int] | None = None
    offload_folder: str | None = None
    source: str = ""  # how messages name it: "--device-map auto", "--device-map FILE.json"

    @property
    def strategy(self) -> str | None:
        return self.device_map if isinstance(self.device_map, str) else None


def placement_from_options(
    device_map: str | None, max_memory: str | None = None, offload_folder: str | None = None, device: str | None = None
) -> Placement | None:
    """The `Placement` the options ask for, or None without `--device-map` (one device, `--device`).

    `--device` with `--device-map` is refused: the map places the target, and a second answer to
    "where" would be ignored or contradict it."""
    if device_map is None:
        given = [name for name, v in (("--max-memory", max_memory), ("--offload-folder", offload_folder)) if v]
        if given:
            raise ValueError(
                f"{' and '.join(given)} apply to a target placed with --device-map; give --device-map "
                f"({', '.join(DEVICE_MAP_STRATEGIES)} or a JSON file) or leave them out"
            )
        return None
    if device:
        raise ValueError(
            f"--device {device} and --device-map {device_map} together: the device map places the "
            "target (its first device is where inputs go); leave out --device"
        )
    limits = parse_max_memory(max_memory) if max_memory else None
    if offload_folder:
        check_offload_folder(offload_folder)
    if device_map in DEVICE_MAP_STRATEGIES:
        return Placement(device_map, limits, offload_folder, f"--device-map {device_map}")
    return Placement(read_device_map(device_map), limits, offload_folder, f"--device-map {device_map}")


def check_offload_folder(folder: str) -> None:
    """--offload-folder: a folder eaglet can create and write in, said plainly before anything loads
    (a dangling link, a path under a file or in /proc otherwise fails deep in accelerate with a bare errno)."""
    path = Path(folder)
    if path.is_symlink() and not path.exists():
        raise ValueError(
            f"--offload-folder {folder}: a symbolic link to {os.readlink(path)}, which does not exist; "
            "give a folder (or create the link's target)"
        )
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(
            f"--offload-folder {folder}: {probe} is a file, so no folder can be made there; give a folder path"
        )
    if not os.access(probe, os.W_OK) or str(probe.resolve()).startswith(("/proc", "/sys")):
        raise ValueError(
            f"--offload-folder {folder}: {probe} cannot be written; give a folder on a disk you can write to"
        )


def parse_size(text: str) -> int:
    """Bytes from '70GiB', '512MB', '1.5TB' or a plain integer (bytes), as accelerate writes them."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in UNITS and unit:
        raise ValueError(f"{text!r}: a size such as 70GiB, 512MB or 1000000 (bytes)")
    return int(float(m.group(1)) * UNITS[unit or "b"])


def parse_device(value: object, where: str) -> Device:
    """accelerate's name of a device: a CUDA index, "cpu" or "disk" ("cuda" is cuda:0)."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: {value!r} is not a device")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in (CPU, DISK):
            return text
        m = re.fullmatch(r"(?:cuda(?::(\d+))?|(\d+))", text)
        if m:
            return int(m.group(1) or m.group(2) or 0)
    raise ValueError(f'{where}: {value!r} is not a device; use "cpu", "disk", a CUDA index (0) or "cuda:0"')


def parse_max_memory(text: str) -> dict[Device, int]:
    """`--max-memory 0=70GiB,1=70GiB,cpu=200GiB` -> {0: bytes, 1: bytes, "cpu": bytes}."""
    limits: dict[Device, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, eq, size = item.partition("=")
        if not eq:
            raise ValueError(f"--max-memory {text}: {item!r} is not DEVICE=SIZE (e.g. 0=70GiB,cpu=200GiB)")
        try:
            limits[parse_device(name, f"--max-memory {text}")] = parse_size(size)
        except ValueError as e:
            raise ValueError(f"--max-memory {text}: {e}") from None
    if DISK in limits:
        raise ValueError(f"--max-memory {text}: disk is bounded by the free space of --offload-folder, not a limit")
    return limits


def read_device_map(path: str) -> dict[str, Device]:
    """A JSON file {module name: device}, e.g. {"model.embed_tokens": 0, "model.layers.0": 0, ...,
    "model.layers.60": "disk", "model.norm": 0, "lm_head": 0}; "" names the whole model."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--device-map {path}: not {', '.join(DEVICE_MAP_STRATEGIES)} and no such file")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ValueError(f"--device-map {path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            f"{path}: a device map is a JSON object {{module name: device}}, e.g. "
            '{"model.layers.0": 0, "model.layers.1": "cpu"}'
        )
    return {str(name): parse_device(dev, f'{path}: "{name}"') for name, dev in raw.items()}


# ---------------------------------------------------------------------------------------------
# What a map places where, and whether it fits
# ---------------------------------------------------------------------------------------------


def owner(name: str, device_map: dict[str, Device]) -> str | None:
    """The map's key that places tensor or module `name`: itself or its longest prefix ("" for all)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in device_map:
            return key
    return "" if "" in device_map else None


def unplaced(tensor_names: list[str], device_map: dict[str, Device]) -> list[str]:
    """Tensors (parameters and buffers) the map places nowhere."""
    return [n for n in tensor_names if owner(n, device_map) is None]


def unknown_keys(device_map: dict[str, Device], module_names: set[str]) -> list[str]:
    """Keys that name no module or tensor of the model (a typo places nothing)."""
    return [k for k in device_map if k and k not in module_names]


def bytes_per_device(device_map: dict[str, Device], tensor_bytes: dict[str, int]) -> dict[Device, int]:
    """Bytes of weights and buffers each device holds under the map."""
    totals: dict[Device, int] = {}
    for name, size in tensor_bytes.items():
        key = owner(name, device_map)
        if key is not None:
            dev = device_map[key]
            totals[dev] = totals.get(dev, 0) + size
    return totals


def device_order(dev: Device) -> tuple[int, int]:
    """GPUs by index, then the CPU, then disk: the order a strategy fills them."""
    return (0, dev) if isinstance(dev, int) else (1, 0 if dev == CPU else 1)


def device_name(dev: Device) -> str:
    return f"cuda:{dev}" if isinstance(dev, int) else dev


def size_text(n: int) -> str:
    """'1,234,567,890 bytes (1.15 GiB)': exact, and readable."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.2f} {unit})"
    return f"{n:,} bytes"


def fit_problems(needed: dict[Device, int], available: dict[Device, int], cuda_devices: int) -> list[str]:
    """One line per device the placement overfills, or names without having it (a CUDA index
    past `cuda_devices`). `available` holds what each device has (measured, or --max-memory)."""
    problems = []
    for dev, need in sorted(needed.items(), key=lambda kv: device_order(kv[0])):
        if isinstance(dev, int) and dev >= cuda_devices:
            problems.append(
                f"{device_name(dev)}: needs {size_text(need)}, but this machine has "
                f"{cuda_devices} CUDA device{'' if cuda_devices == 1 else 's'}"
            )
        elif need > available.get(dev, 0):
            problems.append(f"{device_name(dev)}: needs {size_text(need)}, has {size_text(available.get(dev, 0))}")
    return problems


def refuse_unfit(
    placement: Placement, needed: dict[Device, int], available: dict[Device, int], cuda_devices: int, target: str
) -> None:
    """Refuse, before any weight loads, a placement whose weights do not fit where it puts them."""
    problems = fit_problems(needed, available, cuda_devices)
    if problems:
        total = sum(needed.values())
        raise ValueError(
            f"{placement.source}: target {target} ({size_text(total)} of weights) does not fit: "
            + "; ".join(problems)
            + ". Place fewer layers there (a JSON map), raise --max-memory, or "
            'offload to "disk" with an --offload-folder that has the space'
        )


def pieces_on_disk(device_map: dict[str, Device], pieces: dict[str, str]) -> list[str]:
    """Of `pieces` ({module name: what it is}), those the map offloads to disk. eaglet reads their
    weights itself (the drafter copies the embeddings, the teacher the final norm and LM head),
    and a disk-offloaded module's weights are empty placeholders outside its own forward."""
    return [
        f"{what} ({name})"
        for name, what in pieces.items()
        if (key := owner(name, device_map)) is not None and device_map[key] == DISK
    ]


def pieces_to_cpu(
    device_map: dict[str, Device], pieces: dict[str, str], children: dict[str, list[str]]
) -> dict[str, Device]:
    """A strategy's map with the pieces eaglet reads (`pieces_on_disk`) moved from disk to the CPU.
    A piece placed by a parent's key ("" or "model" on disk) gets its own: the parent's key is
    split into its children's (`children`: module -> its direct submodules and tensors)."""
    moved = dict(device_map)
    for name in pieces:
        key = owner(name, moved)
        while key is not None and key != name and moved[key] == DISK and children.get(key):
            dev = moved.pop(key)
            moved |= dict.fromkeys(children[key], dev)
            key = owner(name, moved)
        if key == name and moved[key] == DISK:
            moved[key] = CPU
    return moved


__all__ = [
    "Placement",
    "placement_from_options",
    "parse_max_memory",
    "parse_size",
    "read_device_map",
    "bytes_per_device",
    "fit_problems",
    "refuse_unfit",
    "pieces_on_disk",
    "pieces_to_cpu",
    "unplaced",
    "unknown_keys",
    "size_text",
]
