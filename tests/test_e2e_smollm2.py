"""End-to-end on the embedded default: SmolLM2-135M-Instruct and real ShareGPT chats."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglet import embedded, formats
from eaglet.cli import main
from eaglet.prepare import prepare
from eaglet.extract import extract
from eaglet.target import load_target, parse_dtype, resolve_target
from eaglet.options import ExtractOptions, PrepareOptions

pytestmark = pytest.mark.slow


def test_cache_is_a_faithful_plain_safetensors_copy_of_the_gguf(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert (smollm2_dir / "model.safetensors").exists() and (smollm2_dir / "tokenizer.json").exists()
    gguf = embedded.smollm2_gguf()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    cached = load_target(resolve_target(None), torch.float32, torch.device("cpu"))
    ids = torch.tensor([[1, 504, 3458, 282, 260, 1345, 30, 2]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, cached(ids).logits)


def test_stray_temp_folder_is_never_used(smollm2_dir):
    (smollm2_dir.parent / f".{smollm2_dir.name}.tmp-dead").mkdir()
    assert resolve_target(None).path == str(smollm2_dir)


def test_stored_aux_states_equal_output_hidden_states(smollm2_dir, tmp_path):
    """Every stored state is the target's own, at the dtype extraction computed in, rounded once to
    the stored dtype; the last slot is the final norm's input (pre-norm)."""
    prepare(PrepareOptions(target=None, data="sharegpt", out=tmp_path / "prep", max_length=256, num_samples=4))
    extract(
        ExtractOptions(prepared=tmp_path / "prep", out=tmp_path / "data", target=None, max_batch_size=1),
        show_progress=False,
    )
    cfg = formats.read_json(tmp_path / "data" / "data_config.json")
    assert cfg["layer_ids"] == [2, 15, 27, 30] and cfg["last_hidden_state"] == "pre_norm"
    stored = parse_dtype(cfg["hidden_states_dtype"])
    model = load_target(resolve_target(None), parse_dtype(cfg["compute_dtype"]), torch.device("cpu"))
    norm_inputs = []
    model.model.norm.register_forward_hook(lambda module, args, out: norm_inputs.append(args[0]))
    for i, path in sorted(formats.list_v1_files(tmp_path / "data").items()):
        s = formats.read_v1_sample(path)
        norm_inputs.clear()
        with torch.no_grad():
            hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
        for slot, layer_id in enumerate(cfg["layer_ids"][:-1]):
            assert torch.equal(s.hidden_states[slot], hs[layer_id][0].to(stored)), f"sample {i} slot {slot}"
        (pre_norm,) = norm_inputs
        assert torch.equal(s.hidden_states[-1], pre_norm[0].to(stored)), f"sample {i} last slot"
        with torch.no_grad():
            assert torch.equal(model.model.norm(pre_norm), hs[30])  # hidden_states[-1] is post-norm


def test_demo_command(smollm2_dir, tmp_path, capsys):
    """The README's main job at a tiny scale: every stage runs on SmolLM2 and real data, the
    summary table comes out, and a second run reuses every stage."""
    tiny = [
        "--set",
        "regen.num_samples=3",
        "--set",
        "regen.max_new_tokens=24",
        "--set",
        "train.time_budget=10",
        "--set",
        "train.eval_fraction=0.34",
        "--set",
        "eval.num_prompts=1",
        "--set",
        "eval.max_new_tokens=12",
    ]
    threads = torch.get_num_threads()
    try:
        assert main(["demo", "--out", str(tmp_path / "demo"), *tiny]) == 0
    finally:
        torch.set_num_threads(threads)  # eval pins one thread
    text = capsys.readouterr().out
    assert "bytes/token" in text and "result: CLEAN" in text
    assert "slot 1 = layer 15" in text  # layer identity was checked against the target
    assert len(formats.list_v1_files(tmp_path / "demo" / "data")) == 3  # regen.num_samples=3
    for stage in ("regen", "prepare", "extract", "check", "train", "eval"):
        assert f"\n{stage} " in text, stage  # one summary row per stage
    assert "mtbench chain: tau" in text and "mtbench hybrid: tau" in text  # the one drafter, measured
    assert (tmp_path / "demo" / "eval" / "eval.png").exists()
    assert "why: one family, EAGLE-3, for the whole training budget" in text  # the summary says why
    assert main(["demo", "--out", str(tmp_path / "demo"), *tiny]) == 0
    assert capsys.readouterr().out.count("reusing it") == 6


class NoisyOracle:
    """Proposes SmolLM2's own greedy continuation with one wrong token at a seeded depth, so
    cycles accept every length from 0 to the full depth; in tree mode the wrong token's right
    sibling comes second, so the walk must skip a rejected node."""

    aux_layer_ids: list[int] = []

    def __init__(self, full: list[int], seed: int):
        self.full, self.rng, self.seq = full, torch.Generator().manual_seed(seed), []

    def observe(self, seq, aux) -> None:
        self.seq = list(seq)

    def propose(self, max_depth: int, top_k: int, total_tokens: int):
        from eaglet.decode import DraftTree

        n = len(self.seq)
        truth = self.full[n : n + max_depth] if self.full[:n] == self.seq else []
        wrong_at = int(torch.randint(0, max_depth + 1, (1,), generator=self.rng))
        tokens, parents, parent = [], [], -1
        for d, t in enumerate(truth):
            if d == wrong_at:
                tokens.append((t + 1) % 49152)
                parents.append(parent)
                if top_k == 1:
                    break  # a chain stops at its wrong token
            if len(tokens) + 1 > total_tokens:
                break
            tokens.append(t)
            parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree(tokens, parents)


def test_speculative_greedy_equals_plain_greedy_on_smollm2(smollm2_dir):
    """fp32, real prompts: chain and tree decoding give SmolLM2's own greedy output token for
    token, with a random EAGLE-3 drafter (almost nothing accepted) and with a proposer that is
    right up to a random depth (every acceptance length, rejected siblings)."""
    from eaglet.chat import chat_prompt_ids
    from eaglet.decode import speculative_generate
    from references import plain_greedy  # tests/references.py
    from eaglet.drafter import DraftConfig, Eagle3Draft, load_embeddings_from
    from eaglet.evaluate import load_prompt_set
    from eaglet.chat import stop_token_ids
    from eaglet.layers import default_layer_ids
    from eaglet.target import load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = resolve_target(None)
        model, tokenizer = load_target(ref, torch.float32, torch.device("cpu")), load_tokenizer(ref)
        eos = sorted(stop_token_ids(model, tokenizer))
        torch.manual_seed(0)
        drafter = Eagle3Draft(DraftConfig.from_target(model.config, default_layer_ids(30)[:3])).eval()
        load_embeddings_from(drafter, model.get_input_embeddings().weight)
        prompts = load_prompt_set("mtbench", 3) + load_prompt_set("humaneval", 1)
        accepted = cycles = 0
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])
                plain = plain_greedy(model, ids, 32, eos)
                if i % 2 == 0:  # the slowest case (about one token per cycle): half the prompts
                    out, _ = speculative_generate(
                        model, drafter, ids, 32, eos, mode="tree", depth=3, top_k=3, total_tokens=8
                    )
                    assert out == plain, f"{p.id}: random drafter, tree"
                for mode, top_k in (("chain", 1), ("tree", 2)):
                    oracle = NoisyOracle(ids + plain, seed=i)
                    out, stats = speculative_generate(
                        model, oracle, ids, 32, eos, mode=mode, depth=5, top_k=top_k, total_tokens=10
                    )
                    assert out == plain, f"{p.id}: noisy oracle, {mode}"
                    accepted += stats.new_tokens - stats.verify_forwards - 1
                    cycles += stats.verify_forwards
        assert accepted / cycles > 1.5  # the oracle's drafts were mostly taken: the accept path ran
    finally:
        torch.set_num_threads(threads)


def test_gpu_train_script_round_trip_on_cpu(smollm2_dir, tmp_path):
    """scripts/gpu_train.py at a tiny scale on the CPU: pack the target and chats into upload-sized
    folders, rebuild and train online from them alone, bring the drafter back as a checkpoint
    whose weights are the run's best (embeddings restored from the target)."""
    import importlib.util

    from safetensors.torch import load_file

    from eaglet.drafter.files import load_drafter
    from eaglet.training.checkpoints import iter_metrics

    spec = importlib.util.spec_from_file_location("gpu_train", "scripts/gpu_train.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    pack = tmp_path / "gpu_pack"
    gpu.pack(pack, num_samples=6, skip=800, max_length=256, extra_prepared=[])
    uploads = sorted(pack.glob("upload_*"))
    assert len(uploads) >= 2  # the 98 MB GGUF does not fit one upload
    for upload in uploads:
        assert sum(f.stat().st_size for f in upload.iterdir()) < gpu.UPLOAD_LIMIT - gpu.tracked_tree_bytes()
    partial = tmp_path / "partial"
    shutil.copytree(uploads[0], partial / uploads[0].name)
    with pytest.raises(SystemExit, match="upload_2"):  # a missing part names the upload folder that holds it
        gpu.run(partial, tmp_path / "x", 5.0, "cpu", {}, tmp_path / "w0")
    out = tmp_path / "device_out"
    options = dict(gpu.GPU_DEFAULTS, batch_size=2, eval_fraction=0.34, max_length=256, ttt_steps=2)
    gpu.run(pack, out, 8.0, "cpu", options, tmp_path / "work")
    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) <= 8 and all(f.stat().st_size < 16 << 20 for f in files)
    assert not any("embed_tokens.weight" in load_file(str(f)) for f in (out / "drafter").glob("*.safetensors"))
    assert any(r["split"] == "eval" for r in iter_metrics(out))
    gpu.finish(out, tmp_path / "drafter", None)
    drafter = load_drafter(tmp_path / "drafter")
    best = load_drafter(tmp_path / "work" / "run")
    target = load_target(resolve_target(None), torch.float32, torch.device("cpu"))
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    for name, t in best.state_dict().items():  # bf16 on the way back
        torch.testing.assert_close(drafter.state_dict()[name].float(), t.float(), rtol=1e-2, atol=1e-2, msg=name)
