"""Recipes (`eaglet run`, `eaglet demo`): parsing, scaling, validation, and a whole pipeline on
the tiny target that resumes stage by stage."""

from __future__ import annotations

import pytest
import torch

from eaglet import formats
from eaglet.recipe import (apply_overrides, apply_scale, builtin_recipes, load_recipe, parse_override, run_recipe,
                           validate)

from conftest import CHATS, write_jsonl


def test_builtin_recipes_load_and_validate():
    assert {"demo", "smollm2-sharegpt"} <= set(builtin_recipes())
    for name in builtin_recipes():
        recipe = load_recipe(name)
        validate(recipe)
        assert recipe["recipe"]["name"] == name
        assert list(recipe)[-1] == "eval" or "eval" in recipe


def test_overrides_and_scale():
    assert parse_override("train.total_steps=100") == ("train", "total_steps", 100)
    assert parse_override("eval.prompt_sets=['mtbench', 'humaneval']") == ("eval", "prompt_sets",
                                                                          ["mtbench", "humaneval"])
    assert parse_override("recipe.target=org/model") == ("recipe", "target", "org/model")
    assert parse_override("train.bf16=false") == ("train", "bf16", False)
    with pytest.raises(ValueError, match="expected STAGE.KEY=VALUE"):
        parse_override("total_steps=3")
    recipe = load_recipe("demo")
    scaled = apply_scale(recipe, 2.5)
    assert scaled["regen"]["num_samples"] == round(recipe["regen"]["num_samples"] * 2.5)
    assert scaled["train"] == recipe["train"]  # only what [scale] names grows
    assert apply_scale(recipe, 0.001)["regen"]["num_samples"] == 1
    assert recipe["regen"]["num_samples"] == load_recipe("demo")["regen"]["num_samples"]  # input untouched
    with pytest.raises(ValueError, match="unknown stage 'trian'"):
        apply_overrides(recipe, ["trian.lr=1"])


def test_bad_recipes_fail_before_any_work(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 1e-4\n")
    with pytest.raises(ValueError, match=r"recipe \[train\]: unknown options \['learning_rate'\]"):
        run_recipe(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    bad.write_text("[trainer]\nlr = 1\n")
    with pytest.raises(ValueError, match="unknown tables"):
        load_recipe(bad)
    bad.write_text("[train\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_recipe(bad)
    with pytest.raises(FileNotFoundError, match="not a built-in recipe"):
        load_recipe("no-such-recipe")


def test_pipeline_on_tiny_target_resumes_and_refuses_changed_options(tiny_target, tmp_path, capsys):
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"id": f"c{i}", "messages": CHATS[i % 3]} for i in range(8)])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Hello there"}])
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(f"""
[recipe]
name = "tiny"
target = "{tiny_target}"

[scale]
multiply = ["regen.num_samples"]

[regen]
data = "{chats}"
num_samples = 4
max_new_tokens = 10
dtype = "fp32"
device = "cpu"

[prepare]
max_length = 256

[extract]
dtype = "fp32"
store_dtype = "fp32"
device = "cpu"

[check]

[train]
total_steps = 3
eval_every = 3
save_every = 3
eval_fraction = 0.25
ttt_steps = 2
device = "cpu"

[eval]
prompt_sets = ["{prompts}"]
max_new_tokens = 8
methods = ["chain", "tree"]
dtype = "fp32"
device = "cpu"
threads = 1
depth = 3
top_k = 2
total_tokens = 5
chain_depth = 3
""")
    threads = torch.get_num_threads()
    try:
        out = tmp_path / "run"
        summary = run_recipe(recipe, out, scale=1.5)  # 1.5 x 4 chats = 6
        stages = summary.stages
        assert list(stages) == ["regen", "prepare", "extract", "check", "train", "eval"]
        assert stages["regen"]["result"]["conversations"] == 6
        assert stages["prepare"]["result"]["samples"] == stages["extract"]["result"]["samples"] == 6
        assert stages["check"]["result"]["verdict"] == "CLEAN"
        assert stages["train"]["result"]["steps"] == 3
        ev = stages["eval"]["result"]["sets"]["prompts"]
        assert ev["chain"]["identical_share"] == ev["tree"]["identical_share"] == 1.0  # fp32: exact
        assert (out / "eval" / "eval.png").exists() and (out / "summary.json").exists()
        assert all(formats.read_json(out / "stages" / f"{s}.json")["seconds"] >= 0 for s in stages)
        text = "\n".join(summary.lines())
        assert "CLEAN" in text and "tau" in text and "total" in text

        again = run_recipe(recipe, out, scale=1.5)
        assert all(rec["reused"] for rec in again.stages.values())
        assert again.stages["eval"]["result"] == stages["eval"]["result"]

        with pytest.raises(ValueError, match=r"train: .* already holds this stage run with other options "
                                             r"\{'total_steps': \(3, 5\)\}"):
            run_recipe(recipe, out, scale=1.5, overrides=["train.total_steps=5"])
        # online training: no extract/check stages, the target runs inside the training loop
        online = tmp_path / "online.toml"
        text = recipe.read_text()
        cut = text[text.index("[extract]"):text.index("[train]")]
        online.write_text(text.replace(cut, "").replace("[train]\n", "[train]\nonline = true\n"))
        summary = run_recipe(online, tmp_path / "online", scale=1.5)
        assert list(summary.stages) == ["regen", "prepare", "train", "eval"]
        assert summary.stages["train"]["result"]["steps"] == 3
        assert formats.read_json(tmp_path / "online" / "train" / "train_config.json")["online"] is True
    finally:
        torch.set_num_threads(threads)
