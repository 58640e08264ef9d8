"""Train the embedded default's drafter on one GPU machine in a few minutes, on far more ShareGPT
tokens than 2 CPU cores can, and bring it back for the CPU's `eaglet eval`.

The GPU machine has its own torch and transformers, nothing can be fetched there, and each job
sent to it takes an upload of at most 64 MiB (the working tree included). So the work is split
in three steps:

    # 1. here (CPU): pack the target (its GGUF file, in parts), the tokenized chats and the GGUF
    #    reader into gpu_pack/upload_1 .. upload_N, each small enough for one upload
    python scripts/gpu_train.py pack --out gpu_pack --num-samples 13000
    # 2. on the GPU machine: one job per folder, each uploading its folder (files stay while the
    #    machine is up); the last job also runs the training and writes the drafter to $OUT
    true                                                          # upload gpu_pack/upload_1
    PYTHONPATH=src python3 scripts/gpu_train.py run --pack gpu_pack --out $OUT --time-budget 6m
                                                                  # upload gpu_pack/upload_2
    # 3. here: turn the returned folder into an eaglet checkpoint (embeddings from the target)
    python scripts/gpu_train.py finish DEVICE_OUT --out runs/gpu-drafter
    eaglet eval runs/gpu-drafter --prompts mtbench --num-prompts 40 --max-new-tokens 128 --threads 1

`pack` prints the exact jobs. `run` checks every part's sha256 (a missing part names the upload
folder that holds it), rebuilds the target folder from the GGUF, checks that its tokenizer is the
one the chats were tokenized with, trains online (the target in the loop, bf16 on the GPU) for
--time-budget, and writes the best drafter in the `eagle` layout without its embeddings (the
target's, restored by `finish`), in bf16 shards under 16 MiB, plus metrics.jsonl and a log.
Tested on CPU with a tiny budget (`run --device cpu`). `finish` reads only the target's embeddings
(`eaglet.heads`), as every offline stage does.

A target too large for this round trip (Kimi-K2.5, DeepSeek-V3) is trained offline on its GPU node
instead, from engine-extracted hidden states and a folder holding only the target's heads
(docs/large-targets.md): `torchrun --nproc_per_node 8 -m eaglet.cli train DATA --target HEADS_FOLDER
--out RUN --device cuda`, each rank printing its host memory after reading the heads.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from eaglet.options import ExportOptions, ImportOptions, PrepareOptions, TrainOptions

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
UPLOAD_LIMIT = 64 * MIB  # what one job may upload, the working tree included
RETURN_FILE_LIMIT = 15 * MIB  # each returned file stays under the 16 MiB a file
MANIFEST = "manifest.json"
TARGET_GGUF = "target.gguf"
PREPARED_GZ = "prepared.jsonl.gz"
SITE = "site"  # pure-Python packages the GPU machine lacks (the GGUF reader)
# 4 packs of 4,096 tokens a micro-batch: the ~16 samples of 1,024 tokens the unpacked default took,
# without their padding. Eager: the target's online forward is most of a GPU step, and the compiled
# drafter step is measured on CPUs only so far.
GPU_DEFAULTS = dict(
    batch_size=4,
    pack_tokens=4096,
    compile=False,
    lr=1e-3,
    ttt_steps=5,
    draft_vocab_size=8192,
    teacher_top_k=16,
    loss_on="all",
    eval_fraction=0.01,
    log_every=20,
    max_length=1024,
)

log = logging.getLogger("gpu_train")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def tracked_tree_bytes() -> int:
    """Bytes of the working tree that travels with every upload (tracked and untracked, not ignored)."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True
    ).stdout
    return sum((REPO / name).stat().st_size for name in out.decode().split("\0") if name and (REPO / name).is_file())


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The vocabulary, merges-level behaviour on a probe and the chat template: equal
    fingerprints tokenize chats identically."""
    from eaglet.chat import template_hash

    probe = "Hello, world! ¿Qué tal? 12345 def f(x):\n    return x ** 2\n"
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer(probe)["input_ids"]).encode())
    h.update(template_hash(tokenizer).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# pack (CPU)
# ---------------------------------------------------------------------------------------------


def merge_prepared(sources: list[Path], out: Path) -> dict[str, Any]:
    """Several `eaglet prepare` outputs (same target) as one, in order."""
    from eaglet import formats

    configs = []
    out.mkdir(parents=True, exist_ok=True)
    with formats.PreparedWriter(out) as writer:
        for src in sources:
            samples, cfg = formats.read_prepared(src)
            configs.append(cfg)
            for s in samples:
                writer.add(formats.TokenizedSample(f"{src.name}/{s.sample_id}", s.input_ids, s.loss_mask))
    revisions = {c["target_revision"] for c in configs}
    if len(revisions) != 1:
        raise SystemExit(f"prepared folders from different targets: {sorted(revisions)}")
    config = {
        **configs[0],
        "sources": [str(s) for s in sources],
        "num_samples": writer.samples,
        "num_tokens": writer.tokens,
        "num_masked_tokens": writer.masked_tokens,
    }
    writer.finish(config)
    return config


def pack(out: Path, num_samples: int, skip: int, max_length: int, extra_prepared: list[Path]) -> None:
    from eaglet import embedded
    from eaglet.prepare import prepare
    from eaglet.target import load_tokenizer, resolve_target

    if out.exists():
        shutil.rmtree(out)
    work = out / "work"
    print(f"tokenizing {num_samples} ShareGPT chats (records from {skip}) with their original answers ...", flush=True)
    prepare(
        PrepareOptions(
            target=None,
            data="sharegpt",
            out=work / "sharegpt",
            max_length=max_length,
            num_samples=num_samples,
            skip=skip,
        )
    )
    config = merge_prepared([work / "sharegpt", *extra_prepared], work / "prepared")
    files: dict[str, Path] = {}
    with open(work / "prepared" / "prepared.jsonl", "rb") as f, gzip.open(work / PREPARED_GZ, "wb", 6) as g:
        shutil.copyfileobj(f, g)
    files[PREPARED_GZ] = work / PREPARED_GZ
    for name in ("prepare_config.json", "token_freq.pt"):
        files[name] = work / "prepared" / name
    import gguf  # the reader transformers needs for GGUF files; pure Python, copied as is

    shutil.copytree(Path(gguf.__file__).parent, work / SITE / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.make_archive(str(work / SITE), "zip", work / SITE)
    files[SITE + ".zip"] = work / (SITE + ".zip")

    tree = tracked_tree_bytes()
    capacity = UPLOAD_LIMIT - tree - 2 * MIB  # margin for what git status may add
    gguf_path = embedded.smollm2_gguf()
    pieces: list[tuple[str, Path, int, int]] = []  # (file name, source, offset, length)
    size = gguf_path.stat().st_size
    for offset in range(0, size, capacity // 2):  # GGUF in halves of an upload, so small files fit beside them
        pieces.append((TARGET_GGUF, gguf_path, offset, min(capacity // 2, size - offset)))
    pieces += [(name, path, 0, path.stat().st_size) for name, path in files.items()]

    uploads: list[list[tuple[str, Path, int, int]]] = [[]]
    for piece in sorted(pieces, key=lambda p: -p[3]):  # first fit, biggest first
        for upload in uploads:
            if sum(p[3] for p in upload) + piece[3] <= capacity:
                upload.append(piece)
                break
        else:
            uploads.append([piece])
    manifest: dict[str, Any] = {
        "files": {},
        "uploads": len(uploads),
        "tokenizer": tokenizer_fingerprint(load_tokenizer(resolve_target(None))),
        "target": embedded.SMOLLM2_NAME,
        "prepared": {k: config[k] for k in ("num_samples", "num_tokens", "num_masked_tokens")},
    }
    for n, upload in enumerate(uploads, start=1):
        folder = out / f"upload_{n}"
        folder.mkdir(parents=True)
        for name, src, offset, length in upload:
            part = folder / f"{name}.part{offset // (capacity // 2) if name == TARGET_GGUF else 0}"
            with open(src, "rb") as f, open(part, "wb") as g:
                f.seek(offset)
                g.write(f.read(length))
            entry = manifest["files"].setdefault(name, {"parts": []})
            entry["parts"].append(
                {
                    "upload": n,
                    "path": str(part.relative_to(out)),
                    "offset": offset,
                    "length": length,
                    "sha256": sha256(part),
                }
            )
    for name, entry in manifest["files"].items():
        entry["parts"].sort(key=lambda p: p["offset"])
        entry["size"] = sum(p["length"] for p in entry["parts"])
    manifest["files"][TARGET_GGUF]["sha256"] = sha256(gguf_path)
    shutil.rmtree(work)
    for n in range(1, len(uploads) + 1):  # the manifest travels with every upload
        (out / f"upload_{n}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    p = manifest["prepared"]
    print(
        f"packed {p['num_samples']:,} chats, {p['num_tokens']:,} tokens ({p['num_masked_tokens']:,} assistant) and "
        f"the target into {len(uploads)} uploads (working tree {tree / MIB:.1f} MiB + at most "
        f"{capacity / MIB:.0f} MiB each):"
    )
    for n in range(1, len(uploads) + 1):
        last = n == len(uploads)
        cmd = (
            "PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/gpu_train.py run --pack gpu_pack --out $OUT "
            "--time-budget 6m"
            if last
            else "true"
        )
        print(f"  job {n}: upload {out.name}/upload_{n}, command: {cmd}")


# ---------------------------------------------------------------------------------------------
# run (GPU machine)
# ---------------------------------------------------------------------------------------------


def assemble(pack_dir: Path, name: str, manifest: dict[str, Any], dest: Path) -> Path:
    entry = manifest["files"][name]
    missing = [p for p in entry["parts"] if not (pack_dir / p["path"]).exists()]
    if missing:
        uploads = sorted({p["upload"] for p in missing})
        raise SystemExit(
            f"{name}: parts missing from {pack_dir} ({[p['path'] for p in missing]}); run the job(s) "
            f"uploading {[f'{pack_dir.name}/upload_{c}' for c in uploads]} first, on the same machine"
        )
    with open(dest, "wb") as g:
        for p in entry["parts"]:
            part = pack_dir / p["path"]
            if sha256(part) != p["sha256"]:
                raise SystemExit(f"{part}: sha256 differs from {MANIFEST}; upload upload_{p['upload']} again")
            with open(part, "rb") as f:
                shutil.copyfileobj(f, g)
    if "sha256" in entry and sha256(dest) != entry["sha256"]:
        raise SystemExit(f"{name}: reassembled file's sha256 differs from {MANIFEST}")
    return dest


def find_manifest(pack_dir: Path) -> dict[str, Any]:
    found = sorted(pack_dir.glob(f"upload_*/{MANIFEST}"))
    if not found:
        raise SystemExit(f"{pack_dir}: no upload_*/{MANIFEST}; upload the folders `pack` made")
    return json.loads(found[0].read_text())


def write_shards(tensors: dict[str, Any], folder: Path, limit: int) -> list[str]:
    """model-0000i-of-0000n.safetensors files under `limit` bytes each, plus their index."""
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    sizes = [0]
    for name, t in sorted(tensors.items()):
        nbytes = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + nbytes > limit:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = t.contiguous()
        sizes[-1] += nbytes
    weight_map, names = {}, []
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        names.append(fname)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return names


def run(
    pack_dir: Path,
    out: Path,
    time_budget: float,
    device: str,
    options: dict[str, Any],
    work: Path = Path("/tmp/eaglet-gpu"),
) -> None:
    import torch

    from eaglet import formats
    from eaglet.export import export_drafter
    from eaglet.target import cache_gguf_model, load_tokenizer, resolve_target
    from eaglet.training.loop import train

    t0 = time.time()
    manifest = find_manifest(pack_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    site = assemble(pack_dir, SITE + ".zip", manifest, work / "site.zip")
    shutil.unpack_archive(site, work / SITE)
    sys.path.insert(0, str(work / SITE))  # transformers looks for the `gguf` package when it reads the file
    gguf_file = assemble(pack_dir, TARGET_GGUF, manifest, work / f"{manifest['target']}.gguf")
    target = cache_gguf_model(gguf_file, work / "target", f"{manifest['target']} from {TARGET_GGUF}")
    ref = resolve_target(str(target))
    if tokenizer_fingerprint(load_tokenizer(ref)) != manifest["tokenizer"]:
        raise SystemExit("the rebuilt target's tokenizer differs from the one the chats were tokenized with")

    prepared = work / "prepared"
    prepared.mkdir()
    with (
        gzip.open(assemble(pack_dir, PREPARED_GZ, manifest, work / PREPARED_GZ), "rb") as f,
        open(prepared / formats.PREPARED_FILE, "wb") as g,
    ):
        shutil.copyfileobj(f, g)
    assemble(pack_dir, formats.TOKEN_FREQ_FILE, manifest, prepared / formats.TOKEN_FREQ_FILE)
    pconfig = json.loads(assemble(pack_dir, formats.PREPARE_CONFIG_FILE, manifest, work / "pc.json").read_text())
    # Same GGUF, same tokenizer (checked above): the chats belong to this rebuilt folder.
    pconfig.update(target=ref.name, target_spec=str(target), target_revision=ref.revision)
    formats.write_json_atomic(prepared / formats.PREPARE_CONFIG_FILE, pconfig)
    log.info("set-up %.0f s: target %s, %s chats", time.time() - t0, target, f"{pconfig['num_samples']:,}")

    run_dir = work / "run"
    summary = train(
        TrainOptions(
            dataset_dir=prepared,
            out_dir=run_dir,
            target=str(target),
            online=True,
            device=device,
            time_budget=time_budget,
            **options,
        )
    )
    print("\n".join(summary.lines()), flush=True)

    exported = work / "export"
    export_drafter(ExportOptions(ckpt=run_dir, out=exported, fmt="eagle", dtype="bf16"))
    tensors = formats.read_weight_files(exported)
    tensors.pop("embed_tokens.weight")  # the target's own: `finish` restores them on the CPU
    drafter = out / "drafter"
    drafter.mkdir(parents=True, exist_ok=True)
    shutil.copy(exported / formats.DRAFTER_CONFIG_FILE, drafter / formats.DRAFTER_CONFIG_FILE)
    write_shards(tensors, drafter, RETURN_FILE_LIMIT)
    shutil.copy(run_dir / "metrics.jsonl", out / "metrics.jsonl")
    record = {
        "summary": summary.lines(),
        "train_tokens": summary.train_tokens,
        "train_seconds": summary.seconds,
        "last_eval": summary.last_eval,
        "options": {**options, "time_budget": time_budget},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "wall_seconds": time.time() - t0,
        "prepared": manifest["prepared"],
    }
    (out / "run.json").write_text(json.dumps(record, indent=1))
    print(f"drafter in {drafter} ({time.time() - t0:.0f} s in all)")


# ---------------------------------------------------------------------------------------------
# finish (CPU)
# ---------------------------------------------------------------------------------------------


def finish(device_out: Path, out: Path, heldout: Path | None) -> None:
    from eaglet.export import import_drafter
    from eaglet.target import ensure_embedded_target

    summary = import_drafter(ImportOptions(src=device_out / "drafter", out=out, target=str(ensure_embedded_target())))
    print("\n".join(summary.lines()))
    run_json = device_out / "run.json"
    if run_json.exists():
        record = json.loads(run_json.read_text())
        print(f"GPU run: {record['device']}, torch {record['torch']}: " + " | ".join(record["summary"]))
    if heldout is not None:
        from eaglet.training.heldout import evaluate_heldout

        r = evaluate_heldout(out, heldout, eval_fraction=0.04, ttt_steps=5)
        print(
            f"held-out acc per TTT step on {heldout}: {' '.join(f'{a:.3f}' for a in r['acc'])}, sim tau {r['tau']:.3f}"
        )
    print(f"next: eaglet eval {out} --prompts mtbench --num-prompts 40 --max-new-tokens 128 --threads 1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="(CPU) target, tokenized chats and GGUF reader into upload-sized folders")
    p.add_argument("--out", type=Path, default=Path("gpu_pack"))
    p.add_argument("--num-samples", type=int, default=13000, help="ShareGPT chats (default 13000)")
    p.add_argument(
        "--skip",
        type=int,
        default=800,
        help="first ShareGPT record (default 800: past the recipes' regenerated chats; eval's held-out "
        "ShareGPT prompts start at 15000)",
    )
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument(
        "--add-prepared",
        type=Path,
        action="append",
        default=[],
        help="also train on this `eaglet prepare` output (e.g. a recipe's regenerated chats)",
    )
    p = sub.add_parser("run", help="(GPU machine) assemble, train online, write the drafter to --out")
    p.add_argument("--pack", type=Path, default=Path("gpu_pack"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--time-budget", default="6m", help="training time (default 6m)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--work", type=Path, default=Path("/tmp/eaglet-gpu"), help="scratch folder (default /tmp/eaglet-gpu)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=f"a training option (defaults {GPU_DEFAULTS})"
    )
    p = sub.add_parser("finish", help="(CPU) the returned folder as an eaglet checkpoint")
    p.add_argument("device_out", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--heldout", type=Path, default=None, help="an extracted dataset: report held-out acceptance")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "pack":
        pack(args.out, args.num_samples, args.skip, args.max_length, args.add_prepared)
    elif args.cmd == "run":
        from eaglet.options import parse_duration
        from eaglet.recipe import parse_value

        options = dict(GPU_DEFAULTS)
        for item in args.set:
            key, _, value = item.partition("=")
            options[key] = parse_value(value)
        run(args.pack, args.out, parse_duration(args.time_budget), args.device, options, args.work)
    else:
        finish(args.device_out, args.out, args.heldout)


if __name__ == "__main__":
    main()
