"""`--device-map` (eaglet.placement, target.load_target): a target placed across devices, some of
its layers offloaded to disk, computes what the same target on one device computes, bit for
bit in fp32, with each module where the map puts it and the offload folder holding the weights
loading converted (a temporary one removed at exit); a placement that cannot fit is refused
before loading, with the bytes; every stage that runs the target takes the option, and offline
training refuses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglet import formats
from eaglet.check import check_dataset
from eaglet.cli import build_parser, stage_options
from eaglet.prepare import prepare
from eaglet.drafter import DraftConfig, Eagle3Draft
from eaglet.evaluate import evaluate
from eaglet.extract import extract
from eaglet.options import STAGES
from eaglet.placement import (
    Placement,
    fit_problems,
    parse_max_memory,
    parse_size,
    placement_from_options,
    read_device_map,
)
from eaglet.target import load_target, plan_device_map, resolve_target
from eaglet.drafter.files import export_config
from eaglet.training.checkpoints import save_checkpoint
from eaglet.training.config import TrainConfig

from conftest import make_tiny_llama, make_tiny_tokenizer, write_jsonl
from eaglet.options import CheckOptions, EvalOptions, ExtractOptions, PrepareOptions, TrainOptions

LAYERS = 4


def make_tiny_deepseek_v3(folder: Path, vocab_size: int) -> None:
    """DeepSeek-V3's architecture at toy size: MLA attention (q/kv LoRA ranks, split rope/nope
    heads), one dense layer, then MoE layers (routed experts in groups + a shared expert)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    DeepseekV3ForCausalLM(config).save_pretrained(folder)


def make_tiny_llama4(folder: Path, vocab_size: int) -> None:
    make_tiny_llama(folder, vocab_size, num_layers=LAYERS)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def target(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    tok = make_tiny_tokenizer(folder)
    (make_tiny_llama4 if request.param == "llama" else make_tiny_deepseek_v3)(folder, len(tok))
    return folder


def split_map(path: Path) -> Path:
    """Layers 0 and 2 in RAM, 1 and 3 offloaded to disk; embeddings, final norm, head on the CPU."""
    placed = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
        **{f"model.layers.{i}": "cpu" if i % 2 == 0 else "disk" for i in range(LAYERS)},
    }
    path.write_text(json.dumps(placed))
    return path


def all_states(out: Path) -> dict[int, list[torch.Tensor]]:
    return {i: formats.read_v1_sample(p).hidden_states for i, p in formats.list_v1_files(out).items()}


# What the offload folder holds under `split_map`. A disk weight stored in the checkpoint as the model
# uses it is memory-mapped from the checkpoint's own safetensors file; one that loading converts
# (DeepSeek-V3's per-expert matrices, merged into one tensor per layer) is re-saved in the folder.
OFFLOAD_FILES = {
    "llama": set(),
    "deepseek_v3": {
        f"model.layers.{i}.mlp.experts.{w}.safetensors" for i in (1, 3) for w in ("gate_up_proj", "down_proj")
    },
}


def model_type(target: Path) -> str:
    return formats.read_json(target / "config.json")["model_type"]


def offloaded(model: torch.nn.Module) -> dict[str, tuple[Path, torch.Tensor]]:
    """{parameter: (the file its weights are read from, the weights as read)} for every parameter
    the model's accelerate hooks bring in from disk for each forward."""
    found = {}
    for prefix, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        if hook is None or not hook.offload:
            continue
        for local, _ in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}"
            found[name] = (Path(hook.weights_map.dataset.index[name]["safetensors_file"]), hook.weights_map[local])
    return found


def test_extract_with_layers_in_ram_and_on_disk_is_bit_identical(target, chats_jsonl, tmp_path):
    """Aux and last states captured from layers on the CPU and offloaded to disk equal, bit for bit
    (fp32), those of the target on one device; the offload folder given holds the disk layers'
    converted weights, and stays."""
    prepared = tmp_path / "prep"
    prepare(PrepareOptions(target=str(target), data=str(chats_jsonl), out=prepared, max_length=256, num_samples=4))
    args = dict(target=str(target), layer_ids=[1, 2, 3, LAYERS], dtype="fp32", store_dtype="fp32", batch_tokens=512)
    extract(ExtractOptions(prepared=prepared, out=tmp_path / "one", device="cpu", **args))
    extract(
        ExtractOptions(
            prepared=prepared,
            out=tmp_path / "mapped",
            device_map=str(split_map(tmp_path / "map.json")),
            offload_folder=str(tmp_path / "offload"),
            **args,
        )
    )
    one, mapped = all_states(tmp_path / "one"), all_states(tmp_path / "mapped")
    assert len(one) == 4 and one.keys() == mapped.keys()
    assert set(os.listdir(tmp_path / "offload")) == OFFLOAD_FILES[model_type(target)]  # kept: the folder was given
    for i in one:
        assert all(torch.equal(a, b) for a, b in zip(one[i], mapped[i], strict=True)), f"sample {i}"
    # the mapped dataset passes a target check that recomputes sampled files with the same map
    report = check_dataset(
        CheckOptions(
            path=tmp_path / "mapped", target=str(target), identity_samples=2, device_map=str(tmp_path / "map.json")
        )
    )
    assert report.clean, report.lines(5)


def test_a_mapped_target_is_placed_as_its_map_says(target, tmp_path):
    """Each module where the map puts it: weights in RAM on the CPU, offloaded ones empty (meta)
    and read for each forward from the checkpoint or the offload folder, which holds the converted
    weights of the disk layers and nothing else; what is read equals the target's weights."""
    ref = resolve_target(str(target))
    path, folder = split_map(tmp_path / "map.json"), tmp_path / "off"
    model = load_target(ref, torch.float32, torch.device("cpu"), placement_from_options(str(path), None, str(folder)))
    assert model.hf_device_map == json.loads(path.read_text())
    on_disk = ("model.layers.1.", "model.layers.3.")
    devices = {n: p.device.type for n, p in model.named_parameters()}
    assert {n for n, d in devices.items() if d == "meta"} == {n for n in devices if n.startswith(on_disk)}
    assert {d for n, d in devices.items() if not n.startswith(on_disk)} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}  # buffers are not offloaded
    read = offloaded(model)
    assert read.keys() == {n for n, d in devices.items() if d == "meta"}
    assert set(os.listdir(folder)) == OFFLOAD_FILES[model_type(target)]
    assert {f for f, _ in read.values()} == {target / "model.safetensors", *(folder / f for f in os.listdir(folder))}
    whole = dict(load_target(ref, torch.float32, torch.device("cpu")).named_parameters())
    assert all(torch.equal(weights, whole[n]) for n, (_, weights) in read.items())


def test_the_default_offload_folder_is_temporary(target, tmp_path):
    """Without --offload-folder the disk weights that need one go to a temporary folder, removed
    when the process exits."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = (
        "import json, os, tempfile; from pathlib import Path; import torch\n"
        "from eaglet.placement import placement_from_options\n"
        "from eaglet.target import load_target, resolve_target\n"
        f"load_target(resolve_target({str(target)!r}), torch.float32, torch.device('cpu'), "
        f"placement_from_options({str(split_map(tmp_path / 'map.json'))!r}))\n"
        "folders = Path(tempfile.gettempdir()).glob('eaglet-offload-*')\n"
        "print(json.dumps({str(f): os.listdir(f) for f in folders}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    during = json.loads(done.stdout.splitlines()[-1])
    assert len(during) == 1 and set(*during.values()) == OFFLOAD_FILES[model_type(target)]
    assert not Path(*during).exists() and not list(tmp.glob("eaglet-offload-*"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    make_tiny_llama4(folder, len(make_tiny_tokenizer(folder)))
    return folder


def test_eval_greedy_with_a_mapped_target_is_exact(llama, tmp_path, monkeypatch):
    """Plain greedy, chain and tree decoding (KV cache kept per layer, rejected tree nodes dropped
    from each layer's cache) give the same tokens, with the same target passes, when the target
    is split over RAM and disk as on one device."""
    import eaglet.evaluate
    from transformers import AutoConfig

    torch.manual_seed(0)
    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(llama), [1, 2, 3], draft_vocab_size=300)
    from eaglet.drafter.files import target_embeddings

    draft = Eagle3Draft(cfg)
    with torch.no_grad():  # the target's, as training gives them (eval compares them)
        draft.embed_tokens.weight.copy_(target_embeddings(str(llama)))
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, draft, export_config(cfg, {"target": str(llama)}), {})
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [{"id": "a", "prompt": "Write a function that adds."}, {"id": "b", "prompt": "Hello there"}],
    )
    settings = dict(max_new_tokens=6, depth=2, top_k=2, total_tokens=4, chain_depth=2)
    real_run_method, decoded = eaglet.evaluate.run_method, []

    def recorded(method, *args):
        run = real_run_method(method, *args)
        decoded.append((method, run.tokens, run.target_forwards))
        return run

    monkeypatch.setattr(eaglet.evaluate, "run_method", recorded)
    runs = {}
    for name, placed in (("one", {"device": "cpu"}), ("mapped", {"device_map": str(split_map(tmp_path / "m.json"))})):
        decoded.clear()
        result = evaluate(
            EvalOptions(
                drafter_path=ckpt,
                target=str(llama),
                prompt_sets=[str(prompts)],
                methods=["chain", "tree"],
                dtype="fp32",
                **settings,
                **placed,
            ),
            progress=False,
        )
        assert all(result.sets["p"][m]["identical_share"] == 1.0 for m in ("chain", "tree"))
        runs[name] = list(decoded)
    assert len(runs["one"]) >= 6 and runs["one"] == runs["mapped"]


def test_a_map_that_cannot_fit_is_refused_with_the_bytes(llama, tmp_path):
    """Everything on a 100 kB CPU, or on a CUDA device this machine lacks: refused before loading,
    saying what each device needs and has."""
    ref = resolve_target(str(llama))
    all_cpu = tmp_path / "cpu.json"
    all_cpu.write_text('{"": "cpu"}')
    small = placement_from_options(str(all_cpu), "cpu=100kB")
    with pytest.raises(
        ValueError,
        match=r"cpu\.json: target .* does not fit: cpu: needs [\d,]+ bytes \(.*\), "
        r"has 100,000 bytes",
    ):
        load_target(ref, torch.float32, torch.device("cpu"), small)
    gpu = tmp_path / "gpu.json"
    gpu.write_text('{"": "cuda:0"}')
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match=r"cuda:0: needs [\d,]+ bytes .*, but this machine has 0 CUDA devices"):
            load_target(ref, torch.float32, torch.device("cpu"), placement_from_options(str(gpu)))
    # the same budget with a strategy: what does not fit in RAM goes to disk, except what eaglet reads itself
    device_map, folder = plan_device_map(
        ref, torch.float32, Placement("sequential", {"cpu": 150_000}, str(tmp_path / "off"), "--device-map x")
    )
    assert "disk" in device_map.values() and folder == str(tmp_path / "off")
    assert device_map["lm_head"] == "cpu" and device_map["model.norm"] == "cpu"


def test_maps_that_place_wrongly_are_refused(llama, tmp_path):
    ref = resolve_target(str(llama))

    def refused(placed: dict, match: str) -> None:
        path = tmp_path / "m.json"
        path.write_text(json.dumps(placed))
        with pytest.raises(ValueError, match=match):
            plan_device_map(ref, torch.float32, placement_from_options(str(path)))

    refused({"model.layer.0": "cpu", "": "cpu"}, "names no module of .*: model.layer.0")
    refused({"model.layers": "cpu"}, r"places none of \d+ tensors, e.g. model.embed_tokens.weight")
    refused({"": "cpu", "lm_head": "disk"}, r"puts the LM head \(lm_head\) on disk")


def test_option_values_are_checked_before_anything_loads(tmp_path):
    assert parse_max_memory("0=70GiB, cpu=1.5TB") == {0: 70 * 2**30, "cpu": 1_500_000_000_000}
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match=r"--max-memory 0:70GiB: '0:70GiB' is not DEVICE=SIZE"):
        parse_max_memory("0:70GiB")
    with pytest.raises(ValueError, match="'12 parsecs': a size such as"):
        parse_max_memory("cpu=12 parsecs")
    path = tmp_path / "m.json"
    path.write_text('{"model.layers.0": "cuda:1", "lm_head": 0, "model.norm": "tpu"}')
    with pytest.raises(ValueError, match=r"\"model.norm\": 'tpu' is not a device"):
        read_device_map(str(path))
    with pytest.raises(FileNotFoundError, match="--device-map nope.json: not auto, balanced, sequential"):
        placement_from_options("nope.json")
    with pytest.raises(ValueError, match="--device cuda:1 and --device-map auto together"):
        placement_from_options("auto", device="cuda:1")
    with pytest.raises(ValueError, match="--max-memory apply to a target placed with --device-map"):
        placement_from_options(None, max_memory="cpu=1GB")
    assert fit_problems({"cpu": 10, 1: 5, 0: 5}, {"cpu": 9, 0: 5}, 1) == [
        "cuda:1: needs 5 bytes, but this machine has 1 CUDA device",
        "cpu: needs 10 bytes, has 9 bytes",
    ]


def test_offline_training_refuses_a_device_map():
    with pytest.raises(ValueError, match="--device-map auto places the target that --online runs"):
        TrainConfig(device_map="auto")
    assert TrainConfig(device_map="auto", online=True).placement() == Placement("auto", None, None, "--device-map auto")


STAGE_ARGS = {
    "extract": ["--prepared", "prep", "--out", "hs"],
    "regen": ["--data", "c.jsonl", "--out", "r.jsonl"],
    "train": ["prep", "--out", "run", "--online"],
    "check": ["hs", "--target", "t"],
    "eval": ["ckpt"],
}


@pytest.mark.parametrize("stage", list(STAGE_ARGS))
def test_every_stage_that_runs_the_target_takes_a_device_map(stage):
    argv = [
        stage,
        *STAGE_ARGS[stage],
        "--device-map",
        "map.json",
        "--max-memory",
        "0=70GiB,cpu=200GiB",
        "--offload-folder",
        "off",
    ]
    args = build_parser().parse_args(argv)
    options = stage_options(STAGES[stage], args)
    assert (options.device_map, options.max_memory, options.offload_folder) == ("map.json", "0=70GiB,cpu=200GiB", "off")


def test_online_training_with_a_mapped_target_trains_as_on_one_device(llama, chats_jsonl, tmp_path):
    """`train --online --device-map`: the states captured from layers in RAM and on disk reach the
    drafter on the training device; the same losses and the same weights as with one device."""
    from safetensors.torch import load_file

    from eaglet.training.checkpoints import iter_metrics
    from eaglet.training.loop import train

    prepare(
        PrepareOptions(target=str(llama), data=str(chats_jsonl), out=tmp_path / "prep", max_length=128, num_samples=6)
    )
    opts = dict(
        online=True,
        target_dtype="fp32",
        bf16=False,
        total_steps=2,
        eval_every=2,
        log_every=1,
        ttt_steps=2,
        batch_size=2,
        aux_layer_ids=[1, 2, 3],
    )
    train(TrainOptions(dataset_dir=tmp_path / "prep", out_dir=tmp_path / "one", **opts))
    train(
        TrainOptions(
            dataset_dir=tmp_path / "prep",
            out_dir=tmp_path / "mapped",
            device_map=str(split_map(tmp_path / "m.json")),
            **opts,
        )
    )
    losses = [[(r["step"], r["split"], r["loss"]) for r in iter_metrics(tmp_path / run)] for run in ("one", "mapped")]
    assert losses[0] == losses[1] and len(losses[0]) >= 2
    a, b = (
        load_file(str(tmp_path / run / "checkpoints" / "step_00000002" / "model.safetensors"))
        for run in ("one", "mapped")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
