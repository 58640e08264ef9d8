"""`eaglet export` / `eaglet import`: bit-exact round trips through the speculators (vLLM) and
EAGLE-3 / SGLang folders, the two config.json layouts, each folder loaded by a minimal loader
written here from the engines' own key names (not eaglet's import code), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet import formats
from eaglet.cli import main as cli_main
from eaglet.drafter import DraftConfig, Eagle3Draft
from eaglet.drafter.files import export_config, load_checkpoint, load_drafter
from eaglet.export import export_drafter, import_drafter
from eaglet.training.checkpoints import save_checkpoint
from helpers import AUX, TARGET, random_drafter, tiny_config, write_checkpoint
from replays import config, sglang_load, vllm_load, weights
from eaglet.options import ExportOptions, ImportOptions


def logits(draft: Eagle3Draft) -> list[torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, draft.config.target_vocab_size, (2, 9))
    aux = torch.randn(2, 9, 3 * draft.config.target_hidden_size)
    with torch.no_grad():
        return draft(ids, aux, steps=3).logits


def tamper(folder: Path, edit) -> None:
    tensors = weights(folder)
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_checkpoint(tmp_path, random_drafter(tiny_config()))


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt,variant",
    [
        ("speculators", {}),
        ("eagle", {}),
        ("speculators", {"fc_norm": True, "norm_output": True}),
        ("speculators", {"norm_before_residual": True}),
        ("eagle", {"norm_before_residual": True}),
        ("speculators", {"sliding_window": 5}),
        ("eagle", {"norm_output": True, "target_hidden_size": 40}),
    ],
)
def test_round_trip_is_bit_exact(tmp_path, fmt, variant):
    draft = random_drafter(tiny_config(**variant))
    ckpt = write_checkpoint(tmp_path, draft)
    out, back = tmp_path / "exported", tmp_path / "back"
    export_drafter(ExportOptions(ckpt=ckpt, out=out, fmt=fmt, dtype="fp32"))
    summary = import_drafter(ImportOptions(src=out, out=back))
    assert summary.source_format == fmt and not summary.embeddings_from_target
    original, returned = weights(ckpt), weights(back)
    assert original.keys() == returned.keys()
    for name, t in original.items():
        assert returned[name].dtype == t.dtype and torch.equal(returned[name], t), name
    assert config(back)["eaglet"]["draft_config"] == draft.config.to_dict()
    before = logits(draft)
    for reloaded in (load_checkpoint(back), load_drafter(out), load_drafter(back)):
        assert all(torch.equal(a, b) for a, b in zip(before, logits(reloaded)))


def test_run_folder_exports_its_best_checkpoint(tmp_path, ckpt):
    formats.write_json_atomic(tmp_path / "checkpoints" / "best.json", {"step": 5, "tau": 1.0, "path": ckpt.name})
    export_drafter(ExportOptions(ckpt=tmp_path, out=tmp_path / "out", fmt="speculators", dtype="fp32"))
    assert torch.equal(weights(tmp_path / "out")["fc.weight"], weights(ckpt)["fc.weight"])


def test_bf16_export_keeps_vocab_map_dtypes(tmp_path, ckpt):
    for fmt in ("speculators", "eagle"):
        out = tmp_path / fmt
        export_drafter(ExportOptions(ckpt=ckpt, out=out, fmt=fmt))  # bf16 is the default
        w = weights(out)
        assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
        assert all(t.dtype == torch.bfloat16 for k, t in w.items() if k not in ("d2t", "t2d"))
        assert torch.equal(w["fc.weight"], weights(ckpt)["fc.weight"].bfloat16())
        assert config(out)["torch_dtype"] == "bfloat16"


def test_cli_export_and_import(tmp_path, ckpt, capsys):
    out, back = tmp_path / "out", tmp_path / "back"
    assert cli_main(["export", str(ckpt), str(out), "--format", "eagle", "--dtype", "fp32"]) == 0
    assert "SGLang" in capsys.readouterr().out
    assert cli_main(["import", str(out), "--out", str(back)]) == 0
    assert torch.equal(weights(back)["lm_head.weight"], weights(ckpt)["lm_head.weight"])
    # An existing, non-empty folder is never overwritten; a failed write leaves no temp folder.
    assert cli_main(["export", str(ckpt), str(out), "--format", "eagle"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "checkpoints", "out"]


# ---------------------------------------------------------------------------------------------
# The two config.json layouts, and minimal engine loaders written from the engines' key names
# ---------------------------------------------------------------------------------------------

LLAMA_KEYS = {
    "model_type": str,
    "num_hidden_layers": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "hidden_act": str,
    "rms_norm_eps": float,
    "rope_theta": float,
    "max_position_embeddings": int,
    "vocab_size": int,
    "tie_word_embeddings": bool,
}


def assert_llama_block(block: dict) -> None:
    for key, typ in LLAMA_KEYS.items():
        assert isinstance(block[key], typ), key
    assert block["model_type"] == "llama" and block["num_hidden_layers"] == 1 and block["hidden_act"] == "silu"
    assert block["vocab_size"] == 50 and block["tie_word_embeddings"] is False  # SGLang ties lm_head otherwise


def test_speculators_config_layout(tmp_path, ckpt):
    export_drafter(
        ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="speculators", verifier="org/other", speculative_tokens=4)
    )
    c = config(tmp_path / "out")
    assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
    assert_llama_block(c["transformer_layer_config"])
    sc = c["speculators_config"]  # what vLLM's SpeculatorsConfig.validate_speculators_config requires
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    ]
    assert sc["verifier"]["name_or_path"] == "org/other" and isinstance(sc["verifier"]["architectures"], list)
    assert c["draft_vocab_size"] == 30 and c["target_hidden_size"] == 32
    assert c["eagle_aux_hidden_state_layer_ids"] == AUX
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert c[flag] is False, flag  # written even when false: vLLM defaults norm_before_residual to true
    assert "embed_tokens.weight" in weights(tmp_path / "out")  # speculators checkpoints carry them
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "default", fmt="speculators"))
    assert config(tmp_path / "default")["speculators_config"]["verifier"]["name_or_path"] == TARGET


def test_eagle_config_layout(tmp_path, ckpt):
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="eagle"))
    c = config(tmp_path / "out")
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert_llama_block(c)
    assert c["draft_vocab_size"] == 30 and c["target_hidden_size"] == 32
    assert c["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM: HF hidden_states ids
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert c["norm_before_residual"] is False and c["norm_output"] is False
    # Ids not starting at 2 are written all the same, with a note: SGLang's reading of them varies by release.
    other = write_checkpoint(tmp_path / "other", random_drafter(tiny_config(aux_layer_ids=[3, 5, 6])))
    summary = export_drafter(ExportOptions(ckpt=other, out=tmp_path / "other_out", fmt="eagle"))
    assert config(tmp_path / "other_out")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert any("#25454" in n for n in summary.notes)


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_vllm_loads_the_export(tmp_path, ckpt, fmt):
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt=fmt, dtype="fp32"))
    hf, loaded = vllm_load(tmp_path / "out")
    assert not hf.get("norm_before_residual")  # eaglet's residual is the un-normalised hidden state
    assert hf["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM reads the top-level ids first, HF indexing
    w = weights(ckpt)
    assert torch.equal(loaded["draft_id_to_target_id"], w["d2t"])
    assert torch.equal(loaded[("model.layers.0.self_attn.qkv_proj.weight", "k")], w["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(loaded["model.layers.0.hidden_norm.weight"], w["midlayer.hidden_norm.weight"])


def test_vllm_loads_the_pre_fc_norm(tmp_path):
    ckpt = write_checkpoint(tmp_path, random_drafter(tiny_config(fc_norm=True)))
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="speculators", dtype="fp32"))
    hf, loaded = vllm_load(tmp_path / "out")
    assert hf["norm_before_fc"] is True
    assert torch.equal(loaded["model.input_norm.weight"], weights(ckpt)["fc_norm.weight"])


@pytest.mark.parametrize("exported", [True, False])
def test_sglang_loads_the_export(tmp_path, ckpt, exported):
    """The eagle export, and a training checkpoint as it is (its config.json is the same layout)."""
    folder = tmp_path / "out" if exported else ckpt
    if exported:
        export_drafter(ExportOptions(ckpt=ckpt, out=folder, fmt="eagle", dtype="fp32"))
    captured, hot, loaded = sglang_load(folder)
    w = weights(ckpt)
    assert captured == AUX  # the target captures the states the drafter was trained on
    assert torch.equal(hot, torch.arange(30) + w["d2t"]) and torch.equal(hot, w["t2d"].nonzero().flatten())
    assert torch.equal(loaded[("model.midlayer.mlp.gate_up_proj.weight", 1)], w["midlayer.mlp.up_proj.weight"])


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def flip_first_marked(w: dict) -> None:
    w["t2d"][w["t2d"].nonzero()[0]] = False


def swap_two_offsets(w: dict) -> None:
    w["d2t"][[0, 1]] = w["d2t"][[1, 0]] + torch.tensor([1, -1])


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda w: w.pop("d2t"), "model.safetensors: field d2t missing (without it the engines map draft id i"),
        (flip_first_marked, "field t2d marks 29 target ids, draft_vocab_size is 30"),
        (swap_two_offsets, "field d2t disagrees with t2d at 2 draft ids"),
        (
            lambda w: w.update({"lm_head.weight": torch.zeros(31, 32)}),
            "field lm_head.weight has shape [31, 32], config.json implies [30, 32]",
        ),
        (lambda w: w.update({"norm.weight": torch.full((32,), float("nan"))}), "field norm.weight holds NaN"),
    ],
)
def test_export_refuses_broken_weights(tmp_path, ckpt, edit, message):
    tamper(ckpt, edit)
    with pytest.raises(ValueError, match="drafter refused") as e:
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="speculators"))
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b"\xff" * 64])
def test_export_names_a_truncated_or_garbage_weights_file(tmp_path, ckpt, damage):
    weights = ckpt / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file, truncated or damaged"):
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="speculators"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "ids,message",
    [([], "field aux_layer_ids is missing or empty"), ([5, 4, 2], "expected 3 strictly increasing integer ids >= 1")],
)
def test_export_refuses_bad_layer_ids(tmp_path, ckpt, ids, message):
    c = config(ckpt)
    c["eaglet"]["draft_config"]["aux_layer_ids"] = ids
    (ckpt / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="config.json: field aux_layer_ids") as e:
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="eagle"))
    assert message in str(e.value)


def test_eagle_export_of_pre_fc_norm_is_what_sglang_0_5_23_reads(tmp_path):
    """SGLang 0.5.23's LlamaForCausalLMEagle3 reads `norm_before_fc` and an `input_norm` before fc
    (llama_eagle3.py): the export writes both, says which SGLang reads them, and imports back."""
    ckpt = write_checkpoint(tmp_path, random_drafter(tiny_config(fc_norm=True)))
    summary = export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="eagle", dtype="fp32"))
    assert config(tmp_path / "out")["norm_before_fc"] is True
    assert torch.equal(weights(tmp_path / "out")["input_norm.weight"], weights(ckpt)["fc_norm.weight"])
    assert any("SGLang reads it from 0.5.23" in n for n in summary.notes)
    import_drafter(ImportOptions(src=tmp_path / "out", out=tmp_path / "back"))
    assert torch.equal(weights(tmp_path / "back")["fc_norm.weight"], weights(ckpt)["fc_norm.weight"])


def test_import_refuses_unknown_and_mismatched_tensors(tmp_path, ckpt):
    out = tmp_path / "out"
    export_drafter(ExportOptions(ckpt=ckpt, out=out, fmt="speculators", dtype="fp32"))
    tamper(out, lambda w: w.update({"fc.bias": torch.zeros(32), "layers.0.self_attn.q_norm.weight": torch.ones(8)}))
    with pytest.raises(ValueError) as e:
        import_drafter(ImportOptions(src=out, out=tmp_path / "back"))
    assert "unknown tensor fc.bias [32]" in str(e.value)
    assert "unknown tensor layers.0.self_attn.q_norm.weight" in str(e.value)
    tamper(
        out,
        lambda w: (
            w.pop("fc.bias"),
            w.pop("layers.0.self_attn.q_norm.weight"),
            w.update({"layers.0.mlp.down_proj.weight": torch.zeros(32, 47)}),
        ),
    )
    with pytest.raises(ValueError, match=r"field layers.0.mlp.down_proj.weight has shape \[32, 47\]"):
        import_drafter(ImportOptions(src=out, out=tmp_path / "back"))
    assert not (tmp_path / "back").exists()


def test_import_refuses_configs_eaglet_cannot_run(tmp_path, ckpt):
    out = tmp_path / "out"
    export_drafter(ExportOptions(ckpt=ckpt, out=out, fmt="speculators", dtype="fp32"))
    c = config(out)
    for edit, message in (
        (lambda c: c.pop("norm_before_residual"), "field norm_before_residual missing"),
        (lambda c: c.update(fc_norm=True), "field fc_norm = True"),
        (lambda c: c.pop("draft_vocab_size"), "field draft_vocab_size missing"),
    ):
        broken = json.loads(json.dumps(c))
        edit(broken)
        (out / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            import_drafter(ImportOptions(src=out, out=tmp_path / "back"))


def test_import_official_eagle_bin_with_target(tmp_path, tiny_target):
    """An official EAGLE-3 style folder: pytorch_model.bin (SGLang-style `model.` names), no
    embeddings and no layer ids; both come from the target."""
    from transformers import AutoConfig

    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target), AUX, draft_vocab_size=64)
    draft = random_drafter(cfg)
    folder = tmp_path / "official"
    folder.mkdir()
    c = formats.build_eagle_config(cfg, "float32", {})
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config", "eaglet_export"):
        c.pop(key)
    (folder / "config.json").write_text(json.dumps(c))
    state = {
        (k if k.startswith("lm_head") or k in ("d2t", "t2d") else "model." + k): v
        for k, v in draft.state_dict().items()
        if k != "embed_tokens.weight"
    }
    torch.save({**state, "model.midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids.*pass the target"):
        import_drafter(ImportOptions(src=folder, out=tmp_path / "back"))
    c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # SGLang's output-of-layer ids
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="field embed_tokens.weight missing .*pass the target"):
        import_drafter(ImportOptions(src=folder, out=tmp_path / "back"))
    summary = import_drafter(ImportOptions(src=folder, out=tmp_path / "back", target=str(tiny_target)))
    assert summary.embeddings_from_target and summary.config.aux_layer_ids == AUX
    back = load_checkpoint(tmp_path / "back")
    target_embed = load_file(str(tiny_target / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(back.embed_tokens.weight, target_embed.float())
    assert torch.equal(back.fc.weight, draft.fc.weight) and torch.equal(back.d2t, draft.d2t)
    c.pop("eagle_config")
    (folder / "config.json").write_text(json.dumps(c))
    assert load_drafter(folder, target=str(tiny_target)).config.aux_layer_ids == AUX  # the engines' default ids


def test_embedded_target_exports_as_its_hub_id(tmp_path, monkeypatch):
    """A drafter trained on the embedded SmolLM2 names the model engines can load, not eaglet's
    record name or a local cache folder."""
    from eaglet import export
    from eaglet.target import embedded_cache_dir, embedded_name

    # the name is under test: this tiny drafter is no drafter of SmolLM2 (export compares that elsewhere)
    monkeypatch.setattr(export, "refuse_other_target", lambda d, target: None)

    draft = random_drafter(tiny_config())
    for i, recorded in enumerate((embedded_name(), str(embedded_cache_dir()))):
        ck = save_checkpoint(
            tmp_path / f"r{i}" / "checkpoints",
            5,
            draft,
            export_config(draft.config, {"step": 5, "target": recorded}),
            {},
        )
        export_drafter(ExportOptions(ckpt=ck, out=tmp_path / f"out{i}", fmt="speculators"))
        assert (
            config(tmp_path / f"out{i}")["speculators_config"]["verifier"]["name_or_path"]
            == "HuggingFaceTB/SmolLM2-135M-Instruct"
        )


@pytest.mark.parametrize(
    "block, window",
    [
        ({"sliding_window": 7, "layer_types": ["sliding_attention"]}, 7),
        ({"sliding_window": 7, "layer_types": ["full_attention"]}, None),
        ({"sliding_window": 7}, None),
    ],
)  # no layer_types: full, as speculators
def test_import_reads_the_sliding_window_as_speculators_does(tmp_path, ckpt, block, window):
    out = tmp_path / "out"
    export_drafter(ExportOptions(ckpt=ckpt, out=out, fmt="speculators", dtype="fp32"))
    c = config(out)
    c["transformer_layer_config"].update(block)
    (out / "config.json").write_text(json.dumps(c))
    import_drafter(ImportOptions(src=out, out=tmp_path / "back"))
    assert load_checkpoint(tmp_path / "back").config.sliding_window == window


class ExecutesOnLoad:
    """A custom class: torch.load(weights_only=False) would import it and run its __setstate__."""

    def __init__(self, marker: str):
        self.marker = marker

    def __getstate__(self) -> dict:
        return {"marker": self.marker}

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).write_text("executed")


def bin_folder(tmp_path: Path, ckpt: Path, extra: dict) -> Path:
    """An EAGLE-3 folder whose weights are a pytorch_model.bin holding the tensors and `extra`."""
    folder = tmp_path / "official"
    export_drafter(ExportOptions(ckpt=ckpt, out=folder, fmt="eagle", dtype="fp32"))
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save({**tensors, **extra}, folder / "pytorch_model.bin")
    return folder


def test_import_of_a_pickle_that_needs_code_says_what_to_do(tmp_path, ckpt, capsys):
    """torch's own message advises weights_only=False (running the file's code) and names no file."""
    marker = tmp_path / "executed"
    folder = bin_folder(tmp_path, ckpt, {"optimizer": ExecutesOnLoad(str(marker))})
    with pytest.raises(ValueError) as e:
        import_drafter(ImportOptions(src=folder, out=tmp_path / "back"))
    message = str(e.value)
    assert message.startswith(f"{folder / 'pytorch_model.bin'}: holds Python objects beyond tensors")
    assert "ExecutesOnLoad" in message and "will not execute" in message and "safetensors" in message
    assert "weights_only=False" not in message and "\n" not in message
    rc = cli_main(["import", str(folder), "--out", str(tmp_path / "back")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"eaglet import: error: {folder / 'pytorch_model.bin'}: ")
    assert "Re-running" not in err and not marker.exists() and not (tmp_path / "back").exists()


def test_import_of_a_damaged_bin_names_it(tmp_path, ckpt):
    folder = bin_folder(tmp_path, ckpt, {})
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02garbage")  # a pickle header, then nonsense
    with pytest.raises(
        ValueError,
        match=r"pytorch_model.bin: not a readable torch file \(Unsupported operand "
        r"\d+\); it is damaged",
    ) as e:
        import_drafter(ImportOptions(src=folder, out=tmp_path / "back"))
    assert "weights_only=False" not in str(e.value)


def test_import_refuses_layers_the_target_lacks_and_a_rope_base_that_is_no_base(tmp_path, tiny_target):
    from transformers import AutoConfig

    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target), AUX, draft_vocab_size=64)
    out = tmp_path / "out"
    formats.write_drafter_folder(tmp_path / "ckpt", export_config(cfg, {}), random_drafter(cfg).state_dict())
    export_drafter(
        ExportOptions(ckpt=tmp_path / "ckpt", out=out, fmt="speculators", dtype="fp32", verifier=str(tiny_target))
    )
    c = config(out)
    c["eagle_aux_hidden_state_layer_ids"] = [2, 4, 50]
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"aux layer ids \[2, 4, 50\] are not all in 0\.\.8, the layers of the target"):
        import_drafter(ImportOptions(src=out, out=tmp_path / "back", target=str(tiny_target)))
    with pytest.raises(ValueError, match=r"rope_theta -1\.0: must be > 0 and finite"):
        DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target), AUX, draft_vocab_size=64, rope_theta=-1.0)
    assert not (tmp_path / "back").exists()


def test_export_refuses_layers_its_recorded_target_lacks(tiny_target, tmp_path):
    """aux_layer_ids beyond the target (an edited config.json) once exported for vLLM as they were;
    a recorded target on this machine is checked (a hub id is the serving machine's to check)."""
    draft = random_drafter(tiny_config(aux_layer_ids=[1, 2, 99]))
    ckpt = save_checkpoint(
        tmp_path / "checkpoints", 5, draft, export_config(draft.config, {"step": 5, "target": str(tiny_target)}), {}
    )
    with pytest.raises(ValueError, match=r"aux layer ids \[1, 2, 99\] are not all in 0..8, the layers of the target"):
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "out", fmt="speculators"))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Every config.json field import reads is checked, by kind and range, naming the file and field
# ---------------------------------------------------------------------------------------------


def layer_block(c: dict) -> dict:
    """The Llama keys: speculators' transformer_layer_config, or an eagle folder's top level."""
    return c.get("transformer_layer_config", c)


def edited_folder(tmp_path: Path, ckpt: Path, fmt: str, edit) -> Path:
    """`ckpt` exported as `fmt` (fmt eaglet: the checkpoint itself), its config.json edited by `edit`."""
    folder = ckpt
    if fmt != "eaglet":
        folder = tmp_path / fmt
        export_drafter(ExportOptions(ckpt=ckpt, out=folder, fmt=fmt, dtype="fp32"))
    c = config(folder)
    edit(c)
    (folder / "config.json").write_text(json.dumps(c))
    return folder


def refusal(tmp_path: Path, folder: Path) -> str:
    """import_drafter's refusal of `folder`, which must leave no output behind."""
    with pytest.raises(ValueError) as e:
        import_drafter(ImportOptions(src=folder, out=tmp_path / "back"))
    assert not (tmp_path / "back").exists()
    return str(e.value)


@pytest.mark.parametrize(
    "fmt,edit,field",
    [
        ("speculators", lambda c: layer_block(c).update(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (
            "speculators",
            lambda c: layer_block(c).update(
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
            ),
            "rope_parameters.partial_rotary_factor",
        ),
        ("eagle", lambda c: c.update(partial_rotary_factor=0.25), "partial_rotary_factor"),
        (
            "eagle",
            lambda c: c.update(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5}),
            "rope_scaling.partial_rotary_factor",
        ),
        ("eaglet", lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor"),  # SGLang serves it as is
    ],
)
def test_import_refuses_a_partial_rotary_factor(tmp_path, ckpt, fmt, edit, field):
    """transformers and vLLM rotate only head_dim * factor dims; eaglet's drafter rotates them all."""
    message = refusal(tmp_path, edited_folder(tmp_path, ckpt, fmt, edit))
    assert "config.json" in message and f"field {field} = " in message and "plain RoPE over the whole head" in message
    whole = edited_folder(tmp_path / "whole", ckpt, fmt, lambda c: layer_block(c).update(partial_rotary_factor=1.0))
    assert import_drafter(ImportOptions(src=whole, out=tmp_path / "back")).config.rope_theta == 10000.0


@pytest.mark.parametrize(
    "fmt,section",
    [
        ("speculators", "rope_parameters"),
        ("eagle", "rope_parameters"),
        ("eagle", "rope_scaling"),
        ("eaglet", "rope_parameters"),
    ],
)
def test_import_refuses_a_rope_theta_that_contradicts_itself(tmp_path, ckpt, fmt, section):
    """transformers takes rope_parameters' rope_theta over the top-level one; eaglet took the other:
    a folder that gives two bases is refused, one that repeats its base is read."""
    folder = edited_folder(
        tmp_path, ckpt, fmt, lambda c: layer_block(c).update({section: {"rope_type": "default", "rope_theta": 50000.0}})
    )
    message = refusal(tmp_path, folder)
    assert (
        "config.json" in message
        and f"field rope_theta = 10000.0 and field {section}.rope_theta = 50000.0 disagree" in message
    )
    same = edited_folder(
        tmp_path / "same",
        ckpt,
        fmt,
        lambda c: layer_block(c).update({section: {"rope_type": "default", "rope_theta": 10000.0}}),
    )
    assert import_drafter(ImportOptions(src=same, out=tmp_path / "back")).config.rope_theta == 10000.0


def proposal(c: dict) -> dict:
    return c["speculators_config"]["proposal_methods"][0]


@pytest.mark.parametrize(
    "fmt,edit,field",
    [
        ("eagle", lambda c: c.update(rms_norm_eps="abc"), "rms_norm_eps = 'abc': expected a finite number > 0"),
        ("eagle", lambda c: c.update(rms_norm_eps=[1]), "rms_norm_eps = [1]: expected a finite number > 0"),
        ("eagle", lambda c: c.update(rope_theta=True), "rope_theta = True: expected a finite number > 0"),
        ("eagle", lambda c: c.update(eagle_config=5), "eagle_config = 5: expected an object"),
        ("eagle", lambda c: c.update(rope_parameters=5), "rope_parameters = 5: expected an object"),
        ("eagle", lambda c: c.update(architectures=5), "architectures = 5: expected a list of class names"),
        ("eagle", lambda c: c.update(eaglet_export=5), "eaglet_export = 5: expected an object"),
        ("eagle", lambda c: c.update(norm_output="false"), "norm_output = 'false': expected true or false"),
        ("eagle", lambda c: c.update(hidden_size=True), "hidden_size = True: expected an integer >= 1"),
        (
            "eagle",
            lambda c: c.update(max_position_embeddings="1024"),
            "max_position_embeddings = '1024': expected an integer >= 1",
        ),
        (
            "eagle",
            lambda c: c.update(max_position_embeddings=0),
            "max_position_embeddings = 0: expected an integer >= 1",
        ),
        (
            "eagle",
            lambda c: c.update(eagle_aux_hidden_state_layer_ids="2,4,5"),
            "eagle_aux_hidden_state_layer_ids = '2,4,5': expected a list of integer layer ids",
        ),
        (
            "speculators",
            lambda c: layer_block(c).update(hidden_size="64"),
            "hidden_size = '64': expected an integer >= 1",
        ),
        (
            "speculators",
            lambda c: layer_block(c).update(num_key_value_heads=2.5),
            "num_key_value_heads = 2.5: expected an integer >= 1",
        ),
        (
            "speculators",
            lambda c: c["speculators_config"].update(verifier=[1]),
            "speculators_config.verifier = [1]: expected an object",
        ),
        (
            "speculators",
            lambda c: proposal(c).update(speculative_tokens="x"),
            "speculators_config.proposal_methods[0].speculative_tokens = 'x': expected an integer >= 1",
        ),
        (
            "speculators",
            lambda c: proposal(c).update(speculative_tokens=0),
            "speculators_config.proposal_methods[0].speculative_tokens = 0: expected an integer >= 1",
        ),
        (
            "speculators",
            lambda c: c.update(target_hidden_size="32"),
            "target_hidden_size = '32': expected an integer >= 1",
        ),
    ],
)
def test_import_names_the_file_and_field_of_a_value_of_the_wrong_kind(tmp_path, ckpt, fmt, edit, field):
    """Once raw TypeErrors, AttributeErrors and float()'s message, or strings and zeros read as numbers."""
    message = refusal(tmp_path, edited_folder(tmp_path, ckpt, fmt, edit))
    assert message.startswith(str(tmp_path / fmt / "config.json")) and f"field {field}" in message


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_import_refuses_quantized_weights_naming_the_dtype(tmp_path, ckpt, fmt):
    """A float8 tensor once failed inside torch.isfinite, naming neither file nor tensor."""
    folder = tmp_path / fmt
    export_drafter(ExportOptions(ckpt=ckpt, out=folder, fmt=fmt, dtype="fp32"))
    tamper(folder, lambda w: w.update({"fc.weight": w["fc.weight"].to(torch.float8_e4m3fn)}))
    message = refusal(tmp_path, folder)
    assert (
        f"{folder / 'model.safetensors'}: field fc.weight is torch.float8_e4m3fn, expected one of torch.float32, "
        "torch.bfloat16, torch.float16, torch.float64"
    ) in message
