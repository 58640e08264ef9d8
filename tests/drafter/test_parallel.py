"""The parallel drafters (P-EAGLE, DFlash): the block's attention, the loss's per-position
statistics, decoding that matches the training forward pass for pass and stays exact against plain
greedy, and training that learns and resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from eaglet import formats
from eaglet.decode import HybridProposer, NgramProposer, ParallelProposer, speculative_generate
from eaglet.drafter import (
    DFLASH,
    P_EAGLE,
    PARALLEL_FAMILIES,
    DraftConfig,
    ParallelDraft,
    build_model,
    Teacher,
    anchor_grid,
    block_loss,
    position_weights,
    predicted_positions,
    stats_summary,
)
from eaglet.drafter.files import load_checkpoint, load_drafter
from eaglet.export import export_drafter, import_drafter
from eaglet.training.checkpoints import iter_metrics
from eaglet.training.config import TrainConfig
from eaglet.training.loop import train
from references import plain_greedy  # tests/references.py
from helpers import AUX_IDS, FAST, PROMPTS, run_weights
from replays import sglang_load, vllm_load
from eaglet.options import EvalOptions, ExportOptions, ImportOptions, TrainOptions


def make_parallel(
    family: str, target_config=None, seed: int = 0, layers: int = 2, block: int = 5, vocab: int = 400
) -> ParallelDraft:
    torch.manual_seed(seed)
    if target_config is not None:
        cfg = DraftConfig.from_target(
            target_config,
            AUX_IDS,
            draft_vocab_size=300,
            family=family,
            num_layers=layers,
            block_size=block,
            mask_token_id=vocab - 1,
        )
    else:
        cfg = DraftConfig(
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=512,
            target_vocab_size=vocab,
            draft_vocab_size=50,
            aux_layer_ids=AUX_IDS,
            family=family,
            num_layers=layers,
            block_size=block,
            mask_token_id=vocab - 1,
        )
    model = build_model(cfg)
    assert isinstance(model, ParallelDraft)
    return model.eval()


def anchor_of(family: str, root: int) -> int:
    """The training anchor whose block the proposer drafts when the root (the last committed
    token, not yet fed to the target) sits at `root`: DFlash's block starts at the root, P-EAGLE's
    depth 0 is the last position with aux states."""
    return root if family == DFLASH else root - 1


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
def test_a_block_sees_only_its_past_and_is_the_same_alone_or_batched(family):
    """A block at anchor a depends on nothing after what it may see (DFlash: tokens <= a, context
    < a; P-EAGLE: tokens <= a+1, states <= a), and on no other block of the batch."""
    m = make_parallel(family, vocab=100)
    torch.manual_seed(1)
    ids, aux = torch.randint(0, 100, (2, 24)), torch.randn(2, 24, 192)
    anchors = anchor_grid(torch.ones(2, 24), None, 3, 1, 1 if family == DFLASH else 2)
    with torch.no_grad():
        batched = m(ids, aux, anchors)
        a = int(anchors[0, 3])
        alone = m(ids[:1], aux[:1], anchors[:1, 3:4])
        later_ids, later_aux = ids[:1].clone(), aux[:1].clone()
        later_ids[0, a + (1 if family == DFLASH else 2) :] = 7
        later_aux[0, a + (0 if family == DFLASH else 1) :] = 0.0
        changed = m(later_ids, later_aux, anchors[:1, 3:4])
    assert len(batched.hidden) == predicted_positions(m.config)
    for k in range(len(batched.hidden)):
        torch.testing.assert_close(alone.hidden[k][0, 0], batched.hidden[k][0, 3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(changed.hidden[k], alone.hidden[k])
        first = 1 if family == DFLASH else 2
        assert int(batched.predicts[k][0, 3]) == a + first + k


def test_packed_blocks_stay_in_their_sample():
    """Two samples packed in one row: a block of the second equals the same block in the sample alone."""
    for family in PARALLEL_FAMILIES:
        m = make_parallel(family, vocab=100)
        torch.manual_seed(2)
        ids, aux = torch.randint(0, 100, (1, 30)), torch.randn(1, 30, 192)
        documents = torch.tensor([[0] * 12 + [1] * 18])
        positions = torch.cat([torch.arange(12), torch.arange(18)])[None]
        with torch.no_grad():
            packed = m(ids, aux, torch.tensor([[20]]), documents=documents, positions=positions)
            alone = m(ids[:, 12:], aux[:, 12:], torch.tensor([[8]]))
        for h_packed, h_alone in zip(packed.hidden, alone.hidden):
            torch.testing.assert_close(h_packed, h_alone, rtol=1e-5, atol=1e-5)


def test_anchor_grid_turns_over_every_counted_position():
    counted = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    seen = set()
    for step in range(3):
        grid = anchor_grid(counted, None, 3, step, 1)
        seen |= {int(a) for a in grid[0] if a >= 0}
        assert all(counted[0, int(a) + 1] for a in grid[0] if a >= 0)
    assert seen == set(range(0, 7))  # a's next token (a + 1) counts for a = 0..6


def test_block_stats_count_acceptance_along_the_block():
    """Position k's accuracy is over blocks whose positions before k were right, so tau is the mean
    number of drafts accepted per block; the loss weights DFlash's later positions less."""
    m = make_parallel(DFLASH, vocab=100, block=4)
    ids = torch.randint(0, 100, (1, 16))
    anchors = torch.tensor([[2, 5, 9]])
    with torch.no_grad():
        out = m(ids, torch.randn(1, 16, 192), anchors)
        argmax = [m.lm_head(h).argmax(-1) for h in out.hidden]  # [1, 3] per position
    target_ids = torch.zeros(1, 16, dtype=torch.long)
    # block 0 right at positions 0, 1, 2; block 1 right at 0 only; block 2 wrong at 0 but right at 1
    right = {(0, 0), (0, 1), (0, 2), (1, 0), (2, 1)}
    for k in range(3):
        for j in range(3):
            p = int(anchors[0, j]) + 1 + k
            target_ids[0, p - 1] = argmax[k][0, j] if (j, k) in right else (argmax[k][0, j] + 1) % 50
    log_probs = torch.log_softmax(torch.randn(1, 16, 50), -1)
    teacher = Teacher(log_probs, target_ids, torch.ones(1, 16, dtype=torch.bool))
    _, stats = block_loss(out, teacher, torch.ones(1, 16), position_weights(DFLASH, 4))
    summary = stats_summary(stats.as_tensor())
    assert summary["positions"] == [3.0, 2.0, 1.0] and summary["acc"] == [2 / 3, 1 / 2, 1.0]
    assert summary["tau"] == pytest.approx((3 + 1 + 0) / 3)  # accepted drafts per block: 3, 1, 0
    w = position_weights(DFLASH, 16)
    assert w[0] == 1.0 and w[1] == pytest.approx(torch.tensor(-1 / 7).exp().item()) and len(w) == 15


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


class Recording(ParallelProposer):
    """Keeps each pass's block outputs with the root position it drafted from."""

    def reset(self) -> None:
        super().reset()
        self.passes: list[tuple[int, torch.Tensor]] = []

    def block_outputs(self) -> torch.Tensor:
        out = super().block_outputs()
        self.passes.append((len(self.seq) - 1, out.clone()))
        return out


@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
def test_decoding_passes_match_the_training_forward_and_stay_exact(target, family):  # noqa: F811
    """Through real accept / reject cycles, every incremental pass equals the training forward at
    that anchor over the final sequence and its target states; greedy output equals plain greedy."""
    drafter = make_parallel(family, target.config, seed=4)
    prompt = PROMPTS[2]
    proposer = Recording(drafter)
    out, stats = speculative_generate(target, proposer, prompt, 20)
    assert out == plain_greedy(target, prompt, 20)
    assert len(proposer.passes) == proposer.draft_forwards >= stats.verify_forwards - 1  # one pass a cycle
    full = torch.tensor([prompt + out])
    with torch.no_grad():
        states = target(full, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in AUX_IDS], dim=-1)
        for root, got in proposer.passes:
            want = drafter(full, aux, torch.tensor([[anchor_of(family, root)]]))
            torch.testing.assert_close(got, torch.stack([h[0, 0] for h in want.hidden]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
def test_parallel_drafters_are_exact_alone_with_a_floor_and_in_the_hybrid(target, family):  # noqa: F811
    drafter = make_parallel(family, target.config, seed=5)
    n = predicted_positions(drafter.config)
    for prompt in PROMPTS:
        ref = plain_greedy(target, prompt, 24)
        assert speculative_generate(target, drafter, prompt, 24, mode="chain", depth=n)[0] == ref
        assert speculative_generate(target, drafter, prompt, 24, mode="chain", depth=n, min_prob=0.5)[0] == ref
        hybrid = HybridProposer(
            ParallelProposer(drafter),
            NgramProposer(3),
            (n, 1, n),
            4,
            pass_costs=(1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6, 2.8),
        )
        out, _ = speculative_generate(
            target, hybrid, prompt, 24, depth=hybrid.limits[0], top_k=1, total_tokens=hybrid.limits[2]
        )
        assert out == ref


def test_a_floor_cuts_the_block_where_the_path_probability_falls():
    m = make_parallel(P_EAGLE, vocab=100, block=6)
    seq, aux = list(range(10, 20)), torch.randn(9, 192)

    def proposal(min_prob: float) -> tuple[list[int], list[float]]:
        p = ParallelProposer(m, min_prob)
        p.observe(seq, aux)
        tree = p.propose(10, 1, 10)
        assert tree.parents == list(range(-1, len(tree) - 1))  # a chain
        return tree.tokens, p.path_log_probs

    tokens, path = proposal(0.0)
    assert len(tokens) == 6
    cut, cut_path = proposal(float(torch.tensor(path[2]).exp()) * 0.999)
    assert cut == tokens[:3] and cut_path == path[:3]


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

PARALLEL = {**FAST, "block_size": 4, "anchor_stride": 2}
PARALLEL.pop("ttt_steps")


@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
def test_parallel_training_learns_resumes_exactly_and_loads(dataset, tmp_path, family):  # noqa: F811
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    opts = {**PARALLEL, "drafter": family}
    summary = train(TrainOptions(dataset_dir=dataset, out_dir=straight, total_steps=8, **opts), show_progress=False)
    train(TrainOptions(dataset_dir=dataset, out_dir=resumed, total_steps=8, stop_after=4, **opts), show_progress=False)
    train(TrainOptions(dataset_dir=dataset, out_dir=resumed, total_steps=8, resume=True, **opts), show_progress=False)
    a, b = run_weights(straight, 8), run_weights(resumed, 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    positions = 3 if family == DFLASH else 4
    records = list(iter_metrics(straight))
    assert all(len(r["acc"]) == positions for r in records)
    train_rec = [r for r in records if r["split"] == "train"]
    assert train_rec[-1]["loss"][0] < train_rec[0]["loss"][0]
    config = json.loads((straight / "train_config.json").read_text())
    assert (config["drafter"], config["block_size"], config["draft_layers"]) == (family, 4, 2)
    model = load_checkpoint(straight / "checkpoints" / f"step_{summary.best_step:08d}")
    assert isinstance(model, ParallelDraft) and model.config.family == family and model.config.num_layers == 2
    assert isinstance(load_drafter(straight), ParallelDraft)
    if family == P_EAGLE:
        assert "mask_hidden" in a and "layers.0.hidden_norm.weight" in a and "layers.1.hidden_norm.weight" not in a
    else:
        assert "hidden_norm.weight" in a and "layers.0.self_attn.q_norm.weight" in a


def test_family_options_are_checked():
    with pytest.raises(ValueError, match="--block-size is a p-eagle / dflash option"):
        TrainConfig(block_size=4)
    with pytest.raises(ValueError, match="--fc-norm is an eagle3 option"):
        TrainConfig(drafter=DFLASH, fc_norm=True)
    with pytest.raises(ValueError, match="--drafter 'medusa'"):
        TrainConfig(drafter="medusa")
    with pytest.raises(ValueError, match="--block-size 1: must be >= 2"):
        TrainConfig(drafter=P_EAGLE, block_size=1)
    cfg = TrainConfig(drafter=DFLASH)
    assert (cfg.block_size, cfg.draft_layers, cfg.anchor_stride, cfg.stat_positions) == (16, 2, 8, 15)
    assert TrainConfig(drafter=P_EAGLE).stat_positions == 8 and TrainConfig(ttt_steps=3).stat_positions == 3


# ---------------------------------------------------------------------------------------------
# Export and import: the engines' loaders replayed
# ---------------------------------------------------------------------------------------------


def weights_of(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def parallel_checkpoint(tmp_path, family: str, tiny_target, **overrides) -> Path:
    """A parallel drafter for the tiny target, saved as an eaglet checkpoint that records it."""
    from transformers import AutoConfig

    from eaglet.drafter.files import export_config
    from eaglet.training.teacher import init_lm_head_from_target
    from eaglet.target import load_heads, resolve_target

    draft = make_parallel(family, AutoConfig.from_pretrained(tiny_target), seed=6, **overrides)
    vocab = torch.tensor(sorted(set(range(0, 400, 2)) | set(range(1, 200, 2))))
    t2d = torch.zeros(draft.config.target_vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    draft.set_draft_vocab(vocab - torch.arange(300), t2d)
    heads = load_heads(resolve_target(str(tiny_target)), torch.float32)
    draft.embed_tokens.weight.data.copy_(heads.embeddings)
    if family == DFLASH:
        init_lm_head_from_target(draft, heads, freeze=True)  # SGLang drafts with the target's head
    folder = tmp_path / f"ckpt-{family}"
    formats.write_drafter_folder(
        folder, export_config(draft.config, {"target": str(tiny_target), "step": 1}), draft.state_dict()
    )
    return folder


@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
def test_speculators_export_is_what_vllm_loads_and_imports_back_exactly(tmp_path, tiny_target, family):
    ckpt = parallel_checkpoint(tmp_path, family, tiny_target)
    summary = export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="speculators", dtype="fp32"))
    hf, loaded = vllm_load(tmp_path / "out")
    w = weights_of(ckpt)
    assert hf["aux"] == AUX_IDS and hf["tokens"] == predicted_positions(load_checkpoint(ckpt).config)
    assert torch.equal(loaded["draft_id_to_target_id"], w["d2t"])
    assert torch.equal(loaded[("model.layers.1.self_attn.qkv_proj.weight", "v")], w["layers.1.self_attn.v_proj.weight"])
    if family == P_EAGLE:
        assert hf["pard_token"] == 399 and torch.equal(loaded["mask_hidden"], w["mask_hidden"].view(1, -1))
        assert "parallel_drafting" in "\n".join(summary.lines())
    else:
        assert hf["dflash_config"] == {"mask_token_id": 399, "target_layer_ids": [1, 3, 4], "causal": False}
    import_drafter(ImportOptions(src=tmp_path / "out", out=tmp_path / "back"))
    back = weights_of(tmp_path / "back")
    assert back.keys() == w.keys() and all(torch.equal(back[k], w[k]) for k in w)
    assert load_checkpoint(tmp_path / "back").config == load_checkpoint(ckpt).config


def test_sglang_dflash_export_loads_and_needs_the_targets_head(tmp_path, tiny_target):
    ckpt = parallel_checkpoint(tmp_path, DFLASH, tiny_target)
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="eagle", dtype="fp32"))
    captured, vocabulary_map, loaded = sglang_load(tmp_path / "out")
    w = weights_of(ckpt)
    assert captured == AUX_IDS and torch.equal(loaded["hidden_norm.weight"], w["hidden_norm.weight"])
    assert vocabulary_map is None  # SGLang drafts DFlash over the target's vocabulary
    back = import_drafter(ImportOptions(src=tmp_path / "out", out=tmp_path / "back"))
    assert back.config.family == DFLASH and back.config.block_size == 5
    # a head of its own would be ignored by SGLang, which drafts with the target's: refused
    own = weights_of(ckpt)
    own["lm_head.weight"] = own["lm_head.weight"] + 0.1
    formats.write_drafter_folder(tmp_path / "own", json.loads((ckpt / "config.json").read_text()), own)
    with pytest.raises(ValueError, match="SGLang's DFLASH drafts with the target's"):
        export_drafter(ExportOptions(ckpt=tmp_path / "own", out=tmp_path / "own_out", fmt="eagle", dtype="fp32"))
    with pytest.raises(ValueError, match="SGLang serves no P-EAGLE"):
        export_drafter(
            ExportOptions(ckpt=parallel_checkpoint(tmp_path, P_EAGLE, tiny_target), out=tmp_path / "p", fmt="eagle")
        )
    with pytest.raises(ValueError, match="llama.cpp serves no DFlash drafter"):
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "x.gguf", fmt="gguf"))


def test_import_of_a_whole_vocabulary_dflash_folder_takes_the_targets_head(tmp_path, tiny_target):
    """z-lab's layout: no embeddings, LM head or vocabulary map; the target supplies them."""
    ckpt = parallel_checkpoint(tmp_path, DFLASH, tiny_target)
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="eagle", dtype="fp32"))
    folder = tmp_path / "out"
    c = json.loads((folder / "config.json").read_text())
    del c["draft_vocab_size"]
    stored = {
        k: v for k, v in weights_of(folder).items() if k not in ("lm_head.weight", "embed_tokens.weight", "d2t", "t2d")
    }
    formats.write_drafter_folder(tmp_path / "zlab", c, stored)
    with pytest.raises(ValueError, match="lm_head.weight missing"):
        import_drafter(ImportOptions(src=tmp_path / "zlab", out=tmp_path / "no"))
    import_drafter(ImportOptions(src=tmp_path / "zlab", out=tmp_path / "back", target=str(tiny_target)))
    model = load_checkpoint(tmp_path / "back")
    assert model.config.draft_vocab_size == 400 and bool(model.t2d.all()) and not bool(model.d2t.any())


def test_eval_runs_a_parallel_drafter_by_its_family_name_exactly(tmp_path, tiny_target):
    from conftest import write_jsonl
    from eaglet.evaluate import evaluate

    ckpt = parallel_checkpoint(tmp_path, DFLASH, tiny_target)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "x", "prompt": "Write a function that adds."}])
    result = evaluate(
        EvalOptions(
            drafter_path=ckpt,
            target=str(tiny_target),
            prompt_sets=[str(prompts)],
            methods=["dflash", "hybrid"],
            max_new_tokens=10,
            dtype="fp32",
            threads=1,
            device="cpu",
            plot=False,
        ),
        progress=False,
    )
    r = result.sets["prompts"]
    assert r["dflash"]["identical_share"] == r["hybrid"]["identical_share"] == 1.0
    with pytest.raises(
        ValueError, match="method chain drafts with the eagle3 family; this drafter is dflash: use --methods dflash"
    ):
        evaluate(
            EvalOptions(
                drafter_path=ckpt,
                target=str(tiny_target),
                prompt_sets=[str(prompts)],
                methods=["chain"],
                dtype="fp32",
                threads=1,
                device="cpu",
                plot=False,
            ),
            progress=False,
        )
