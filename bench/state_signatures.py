"""What tells, without the target, that one slot of one file holds a neighbouring layer's states:
the per-slot scales `eaglet check` compares across files, or the signatures extraction records
for every file (`eaglet.formats.signatures`). On the real default target (SmolLM2-135M-Instruct)
and on a tiny random-weight Llama like the tests' (hidden size 64, 8 layers).

    python bench/state_signatures.py [--samples 8] [--max-length 256]

For each target: `prepare` --samples ShareGPT chats and `extract` them (its default layers);
then, for every slot and each neighbouring layer of the slot's layer (id - 1 and id + 1), one file
at a time gets that slot replaced by the neighbour's states (computed by the target as extraction
computes them, stored in the dataset's dtype), and `eaglet check --no-target` runs twice: with
the recorded signatures, and with them moved aside (the scales alone). Prints, per slot and
neighbour, the signature's relative distance (median over the files; the tolerance is 1e-4) and
how many of the files each check refuses.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eaglet import formats
from eaglet.check import check_dataset
from eaglet.extract import extract
from eaglet.formats import signatures
from eaglet.options import CheckOptions, ExtractOptions, PrepareOptions
from eaglet.prepare import prepare
from eaglet.target import ensure_embedded_target


def tiny_llama(folder: Path, tokenizer_from: Path) -> Path:
    """A random-weight Llama with the real tokenizer (its chat template renders the chats)."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def dataset(target: Path, work: Path, samples: int, max_length: int) -> Path:
    prepare(
        PrepareOptions(
            target=str(target), data="sharegpt", out=work / "prepared", num_samples=samples, max_length=max_length
        )
    )
    extract(ExtractOptions(prepared=work / "prepared", out=work / "data", dtype="fp32"), show_progress=False)
    return work / "data"


def all_layers(model, ids: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    with torch.no_grad():
        return [h[0].to(dtype) for h in model(ids[None], output_hidden_states=True).hidden_states]


def unsign(folder: Path) -> None:
    """The dataset as one without signatures: its log and data_config.json's record of it gone."""
    shutil.rmtree(folder / formats.SIGNATURES_DIR)
    config = formats.read_json(folder / formats.DATA_CONFIG_FILE)
    config.pop("state_signatures")
    formats.write_json_atomic(folder / formats.DATA_CONFIG_FILE, config)


def refused(folder: Path) -> bool:
    return not check_dataset(CheckOptions(path=folder, use_target=False)).clean


def measure(target: Path, work: Path, samples: int, max_length: int) -> list[tuple[str, int, float, int, int, int]]:
    """Per (slot, neighbour): median signature distance, files refused with and without signatures, files."""
    data = dataset(target, work, samples, max_length)
    config = formats.read_data_config(data)
    assert config is not None and config.layer_ids is not None
    layer_ids = config.layer_ids
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    files = sorted(formats.list_v1_files(data).items())
    recorded, _ = formats.read_signatures(data)
    assert recorded is not None
    rows = []
    for j, layer in enumerate(layer_ids):
        for neighbour in (layer - 1, layer + 1):
            if not 0 <= neighbour <= model.config.num_hidden_layers or neighbour in layer_ids:
                continue
            distances, signed, unsigned = [], 0, 0
            for i, path in files:
                copy = work / "tampered"
                shutil.copytree(data, copy)
                sample = torch.load(path, weights_only=True)
                states = list(sample["hidden_states"])
                states[j] = all_layers(model, sample["input_ids"], states[j].dtype)[neighbour]
                sample["hidden_states"] = states
                torch.save(sample, copy / path.relative_to(data))
                recorded_slot = signatures.recorded_slots(recorded[i][-1].slots)[j]
                distances.append(signatures.slot_distance(formats.state_signature([states[j]])[0], recorded_slot))
                signed += refused(copy)
                unsign(copy)
                unsigned += refused(copy)
                shutil.rmtree(copy)
            rows.append(
                (f"slot {j} (layer {layer})", neighbour, statistics.median(distances), signed, unsigned, len(files))
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=256)
    args = ap.parse_args()
    smollm2 = ensure_embedded_target()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory(prefix="eaglet-signatures-") as tmp:
        work = Path(tmp)
        targets = {"SmolLM2-135M-Instruct": smollm2, "tiny random Llama": tiny_llama(work / "tiny", smollm2)}
        print(f"{'target':<24}{'slot':<20}{'neighbour':>10}{'distance':>11}{'signatures':>12}{'scales':>8}")
        for name, target in targets.items():
            (work / name).mkdir()
            for slot, neighbour, distance, signed, unsigned, n in measure(
                target, work / name, args.samples, args.max_length
            ):
                print(
                    f"{name:<24}{slot:<20}{'layer ' + str(neighbour):>10}{distance:>11.2g}"
                    f"{f'{signed}/{n}':>12}{f'{unsigned}/{n}':>8}"
                )


if __name__ == "__main__":
    main()
