"""Recipes (`eaglet run`, `eaglet demo`): parsing, scaling, validation, and a whole pipeline on
the tiny target that resumes stage by stage."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file
import torch

from eaglet import formats
from eaglet.prepare import prepare
from eaglet.recipe import Paths, plan_stages, run_recipe, validate
from eaglet.recipe_file import apply_overrides, apply_scale, builtin_recipes, load_recipe, overridden, parse_override

from conftest import CHATS, write_jsonl
from eaglet.options import PrepareOptions, RunOptions


def test_builtin_recipes_load_and_validate(tmp_path):
    assert {"demo", "smollm2-sharegpt"} <= set(builtin_recipes())
    for name in builtin_recipes():
        recipe = load_recipe(name)
        validate(recipe, name)  # keys, option names and types, [scale] paths
        validate(apply_scale(recipe, 4), name)
        assert recipe["recipe"]["name"] == name
        assert list(recipe)[-1] == "eval" or "eval" in recipe
        # every stage finds the output it reads in a fresh folder
        assert set(plan_stages(recipe, Paths(tmp_path / name), None, name).values()) == {"run"}


def test_overrides_and_scale():
    assert parse_override("train.total_steps=100") == ("train", "total_steps", 100)
    assert parse_override("eval.prompt_sets=['mtbench', 'humaneval']") == (
        "eval",
        "prompt_sets",
        ["mtbench", "humaneval"],
    )
    assert parse_override("recipe.target=org/model") == ("recipe", "target", "org/model")
    assert parse_override("train.bf16=false") == ("train", "bf16", False)
    with pytest.raises(ValueError, match="expected STAGE.KEY=VALUE"):
        parse_override("total_steps=3")
    recipe = load_recipe("demo")
    scaled = apply_scale(recipe, 2.5)
    assert scaled["regen"]["num_samples"] == round(recipe["regen"]["num_samples"] * 2.5)
    assert scaled["train"] == recipe["train"]  # only what [scale] names grows
    assert apply_scale(recipe, 1e-6)["regen"]["num_samples"] == 1  # never below one chat
    assert recipe["regen"]["num_samples"] == load_recipe("demo")["regen"]["num_samples"]  # input untouched
    with pytest.raises(ValueError, match="unknown stage 'trian'"):
        apply_overrides(recipe, ["trian.lr=1"])


def test_bad_recipes_fail_before_any_work(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 1e-4\n")
    with pytest.raises(
        ValueError,
        match=r"bad\.toml \[train\]\.learning_rate: unknown option; "
        r"\[train\] takes .*\blr\b",
    ):
        run_recipe(RunOptions(spec=bad, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    bad.write_text("[trainer]\nlr = 1\n")
    with pytest.raises(ValueError, match="unknown tables"):
        load_recipe(bad)
    bad.write_text("[train\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_recipe(bad)
    with pytest.raises(FileNotFoundError, match="not a built-in recipe"):
        load_recipe("no-such-recipe")
    bad.write_text("train = 3\n")
    with pytest.raises(ValueError, match=r"bad\.toml: train = 3 is not a table; write its options under \[train\]"):
        load_recipe(bad)


def test_unknown_recipe_and_scale_keys_are_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[recipe]\ntargt = "org/model"\n\n[prepare]\n')
    with pytest.raises(
        ValueError,
        match=r"bad\.toml \[recipe\]\.targt: unknown key \(did you mean 'target'\?\); "
        r"\[recipe\] takes description, drafters, name, out, target, why$",
    ):
        run_recipe(RunOptions(spec=bad, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    recipe = load_recipe("demo")
    with pytest.raises(
        ValueError, match=r"^--set recipe\.targt=x \(recipe demo\): unknown key \(did you mean 'target'"
    ):
        validate(apply_overrides(recipe, ["recipe.targt=x"]), "demo", overridden(["recipe.targt=x"]))
    for scale, error in [
        ('multiplier = ["regen.num_samples"]', r"\[scale\]\.multiplier: unknown key \(did you mean 'multiply'\?\)"),
        (
            'multiply = ["regen.num_sample"]',
            r"\[scale\]\.multiply: 'regen\.num_sample' names no stage option "
            r"\(did you mean 'regen\.num_samples'\?\); write STAGE\.OPTION",
        ),
        ('multiply = ["sample.num_samples"]', r"\[scale\]\.multiply: 'sample\.num_samples' names no stage option"),
        (
            'multiply = ["regen.data"]',
            r"\[scale\]\.multiply: 'regen\.data' is a str option, not a number; "
            r".* remove it from multiply",
        ),
        (
            'multiply = "regen.num_samples"',
            r"\[scale\]\.multiply: \"regen\.num_samples\" is a str, expected list of "
            r"str; write \[\"regen\.num_samples\"\]",
        ),
    ]:
        bad.write_text(f"[scale]\n{scale}\n\n[regen]\nnum_samples = 4\n")
        with pytest.raises(ValueError, match=r"bad\.toml " + error):
            run_recipe(RunOptions(spec=bad, out=tmp_path / "out", scale=2))
    assert not (tmp_path / "out").exists()


def test_option_types_are_checked_before_any_stage(tmp_path):
    bad = tmp_path / "bad.toml"
    recipe = '[prepare]\ndata = "chats.jsonl"\n\n[extract]\n\n[train]\ntotal_steps = "4"\nlr = 1\n'
    bad.write_text(recipe)
    with pytest.raises(
        ValueError,
        match=r'bad\.toml \[train\]\.total_steps: "4" is a str, expected int or None; '
        r"write 4$",
    ):
        run_recipe(RunOptions(spec=bad, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # prepare and extract did not run
    fixed = apply_overrides(load_recipe(bad), ["train.total_steps=4"])
    validate(fixed, bad)  # an int where a float is expected (lr = 1) is fine
    with pytest.raises(
        ValueError,
        match=r'^--set train\.total_steps=abc \(recipe .*bad\.toml\): "abc" is a str, '
        r"expected int or None; give it a value of that type$",
    ):
        run_recipe(RunOptions(spec=bad, out=tmp_path / "out", overrides=["train.total_steps=abc"]))
    for table, option, error in [
        (
            "eval",
            'methods = "chain,tree"',
            r'\[eval\]\.methods: "chain,tree" is a str, expected list of str; '
            r'write \["chain", "tree"\]',
        ),
        ("eval", "depth = 2.5", r"\[eval\]\.depth: 2\.5 is a float, expected int"),
        ("train", "ttt_steps = true", r"\[train\]\.ttt_steps: true is a bool, expected int"),
        (
            "train",
            "aux_layer_ids = 3",
            r"\[train\]\.aux_layer_ids: 3 is a int, expected list of int or None; "
            r"write \[3\]",
        ),
        ("regen", 'temperature = "0"', r'\[regen\]\.temperature: "0" is a str, expected float; write 0'),
    ]:
        bad.write_text(f"[{table}]\n{option}\n")
        with pytest.raises(ValueError, match=r"bad\.toml " + error):
            validate(load_recipe(bad), bad)
    bad.write_text('[regen]\ndata = "sharegpt"\n\n[prepare]\ndata = "chats.jsonl"\n')
    with pytest.raises(ValueError, match=r"bad\.toml \[prepare\]\.data: set, but this recipe regenerates"):
        run_recipe(RunOptions(spec=bad, out=tmp_path / "out"))  # before regen runs, not after


def test_a_stage_without_its_input_is_refused_up_front(tmp_path):
    bad = tmp_path / "bad.toml"
    out = tmp_path / "out"
    for tables, error in [
        (
            "[prepare]\n[train]\n",
            r"\[train\] reads the output of extract \(.*data\), but the recipe has no "
            r"\[extract\] table and .* holds no finished extract; add the table \[extract\] "
            r"\(an empty one takes its defaults\) or set online = true in \[train\]",
        ),
        ("[extract]\n[check]\n", r"\[extract\] reads the output of prepare .* add the table \[prepare\]"),
        ("[train]\nonline = true\n", r"\[train\] reads the output of prepare .* add the table \[prepare\]"),
        ("[eval]\n", r"\[eval\] reads the output of train .* add the table \[train\]"),
    ]:
        bad.write_text(tables)
        with pytest.raises(ValueError, match=r"bad\.toml: " + error):
            run_recipe(RunOptions(spec=bad, out=out))
    bad.write_text('[prepare]\ndata = "chats.jsonl"\n[extract]\n[check]\n')
    with pytest.raises(
        ValueError,
        match=r"^--only check,extract: extract reads the output of prepare \(.*prepared\), "
        r"which is not finished in .*; add prepare to --only$",
    ):
        run_recipe(RunOptions(spec=bad, out=out, only=["check", "extract"]))
    with pytest.raises(
        ValueError,
        match=r"^--only train: train reads the output of extract .*; add "
        r"regen,prepare,extract to --only$",
    ):
        run_recipe(RunOptions(spec="demo", out=out, only=["train"]))  # the whole chain at once, not one rerun per stage
    assert not out.exists()
    # a stage outside the recipe that finished in OUT earlier provides its output
    formats.write_json_atomic(Paths(out).marker("extract"), {"options": {}, "result": {}, "seconds": 1.0})
    bad.write_text("[train]\n")
    assert plan_stages(load_recipe(bad), Paths(out), None, bad) == {"train": "run"}
    # ... but not when the stage it read runs again: a prepare redone under a kept extract left the
    # extract of the older chats reused beside the new ones
    bad.write_text('[prepare]\ndata = "chats.jsonl"\n[extract]\n')
    with pytest.raises(
        ValueError,
        match=r"extract\.json: extract finished on the output of prepare, which runs "
        r"again now \(.*prepare\.json is missing\): reusing .*data would pair it "
        r"with data it was not made from; remove .*data and .*extract\.json too",
    ):
        plan_stages(load_recipe(bad), Paths(out), None, bad)


def test_a_finished_prepared_dataset_the_recipe_did_not_record_is_never_replaced(tiny_target, tmp_path):
    """`eaglet run --out DIR` replaced DIR/prepared, a user's finished dataset, without a word."""
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"id": f"c{i}", "messages": CHATS[i % 3]} for i in range(3)])
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[recipe]\ntarget = "{tiny_target}"\n\n[prepare]\ndata = "{chats}"\nmax_length = 256\n')
    out = tmp_path / "run"
    prepare(
        PrepareOptions(target=str(tiny_target), data=str(chats), out=out / "prepared", max_length=128, num_samples=2)
    )
    before = (out / "prepared" / formats.PREPARED_FILE).read_bytes()
    with pytest.raises(FileExistsError, match=r"run: holds prepared, which no eaglet stage marked as its own"):
        run_recipe(RunOptions(spec=recipe, out=out))
    formats.io.mark_output(out, "run")  # in a recipe's own folder even: the stage marker says what the recipe made
    with pytest.raises(
        ValueError,
        match=r"prepared: a finished prepared dataset that .*prepare\.json does not "
        r"record \(made outside this recipe, or its marker removed\); remove",
    ):
        run_recipe(RunOptions(spec=recipe, out=out))
    assert (out / "prepared" / formats.PREPARED_FILE).read_bytes() == before


def test_a_changed_target_is_refused_before_any_stage(tiny_target, tmp_path, capsys):
    target = shutil.copytree(tiny_target, tmp_path / "target")
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"id": f"c{i}", "messages": CHATS[i % 3]} for i in range(3)])
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[recipe]\ntarget = "{target}"\n\n[prepare]\ndata = "{chats}"\nmax_length = 256\n')
    out = tmp_path / "run"
    run_recipe(RunOptions(spec=recipe, out=out))
    marker = out / "stages" / "prepare.json"
    ran_with = formats.read_json(marker)["target"]
    assert ran_with["name"] == str(target.resolve()) and ran_with["revision"]
    assert formats.read_json(out / "summary.json")["target"] == ran_with

    other = shutil.copytree(target, tmp_path / "other")
    with pytest.raises(
        ValueError,
        match=rf"^{marker}: prepare ran with target {target} \(revision \w+\), this run's "
        rf"is {other} \(revision \w+\); use another --out for this target, or delete "
        rf"{out} to start over$",
    ):
        run_recipe(RunOptions(spec=recipe, out=out, overrides=[f'recipe.target="{other}"']))
    weights = load_file(str(target / "model.safetensors"))  # same folder, other heads: another revision
    weights["model.embed_tokens.weight"] += 1
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=rf"prepare ran with target {target} \(revision {ran_with['revision']}\), "
        rf"this run's is {target} \(revision (?!{ran_with['revision']})\w+\)",
    ):
        run_recipe(RunOptions(spec=recipe, out=out))

    # a marker from before markers recorded their target is reused, with a note, and left as it is
    record = formats.read_json(marker)
    del record["target"]
    formats.write_json_atomic(marker, record)
    capsys.readouterr()
    again = run_recipe(RunOptions(spec=recipe, out=out))
    assert again.stages["prepare"]["reused"]
    assert f"note: {marker} does not record its target" in capsys.readouterr().out
    assert "target" not in formats.read_json(marker)


def test_a_chat_file_changed_since_prepare_is_not_reused(tiny_target, tmp_path):
    """The probe reversed the chat file between two runs of a recipe: every stage was reused,
    the drafter still trained on the old chats, and nothing was said."""
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"id": f"c{i}", "messages": CHATS[i % 3]} for i in range(3)])
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[recipe]\ntarget = "{tiny_target}"\n\n[prepare]\ndata = "{chats}"\nmax_length = 256\n')
    out = tmp_path / "run"
    run_recipe(RunOptions(spec=recipe, out=out))
    assert run_recipe(RunOptions(spec=recipe, out=out)).stages["prepare"]["reused"]  # the same file: reused
    chats.write_text("".join(reversed(chats.read_text().splitlines(keepends=True))))
    with pytest.raises(ValueError, match=rf"prepare: {chats} changed since {out} ran this stage .* remove {out}"):
        run_recipe(RunOptions(spec=recipe, out=out))


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
        summary = run_recipe(RunOptions(spec=recipe, out=out, scale=1.5))  # 1.5 x 4 chats = 6
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

        again = run_recipe(RunOptions(spec=recipe, out=out, scale=1.5))
        assert all(rec["reused"] for rec in again.stages.values())
        assert again.stages["eval"]["result"] == stages["eval"]["result"]

        with pytest.raises(
            ValueError,
            match=r"train: .* already holds this stage run with other options "
            r"\{'total_steps': \(3, 5\)\}",
        ):
            run_recipe(RunOptions(spec=recipe, out=out, scale=1.5, overrides=["train.total_steps=5"]))
        # online training: no extract/check stages, the target runs inside the training loop
        online = tmp_path / "online.toml"
        text = recipe.read_text()
        cut = text[text.index("[extract]") : text.index("[train]")]
        online.write_text(text.replace(cut, "").replace("[train]\n", "[train]\nonline = true\n"))
        summary = run_recipe(RunOptions(spec=online, out=tmp_path / "online", scale=1.5))
        assert list(summary.stages) == ["regen", "prepare", "train", "eval"]
        assert summary.stages["train"]["result"]["steps"] == 3
        assert formats.read_json(tmp_path / "online" / "train" / "train_config.json")["online"] is True

        # [recipe] drafters: one drafter per family on the finished data, each measured, the fastest kept
        families = tmp_path / "families.toml"
        families.write_text(text.replace('name = "tiny"', 'name = "tiny"\ndrafters = ["eagle3", "p-eagle"]'))
        with pytest.raises(ValueError, match=r"other options \{'drafters': \(None, \['eagle3', 'p-eagle'\]\)\}"):
            run_recipe(RunOptions(spec=families, out=out, scale=1.5))
        for stage in ("train", "eval"):  # as the refusal says: the data stages are reused
            shutil.rmtree(out / stage)
            (out / "stages" / f"{stage}.json").unlink()
        summary = run_recipe(RunOptions(spec=families, out=out, scale=1.5))
        train_runs = summary.stages["train"]["result"]["families"]
        assert list(train_runs) == ["eagle3", "p-eagle"] and train_runs["p-eagle"]["drafter"] == "p-eagle"
        assert formats.read_json(out / "train" / "p-eagle" / "train_config.json")["drafter"] == "p-eagle"
        evals = summary.stages["eval"]["result"]
        assert set(evals["families"]["p-eagle"]["sets"]["prompts"]) == {"plain", "p-eagle"}  # its own block
        assert evals["families"]["p-eagle"]["sets"]["prompts"]["p-eagle"]["identical_share"] == 1.0
        kept = evals["kept"]
        assert kept["family"] in ("eagle3", "p-eagle") and "plain greedy" in kept["why"]
        assert f"kept {kept['family']}" in "\n".join(summary.lines())
        with pytest.raises(ValueError, match="names a family twice"):
            run_recipe(
                RunOptions(spec=families, out=tmp_path / "x", overrides=['recipe.drafters=["dflash", "dflash"]'])
            )
    finally:
        torch.set_num_threads(threads)


def test_a_recipe_file_sends_no_key_and_writes_nowhere_else(tmp_path, monkeypatch):
    """A downloaded recipe once sent $OPENAI_API_KEY to the base_url it named, wrote an offload
    folder anywhere and ran in the working folder itself ([recipe] out = ".")."""
    from eaglet.recipe import recipe_out, validate

    monkeypatch.chdir(tmp_path)
    recipe = {"recipe": {"name": "r"}, "regen": {"backend": "openai", "base_url": "http://127.0.0.1:1/v1"}}
    with pytest.raises(
        ValueError,
        match=r"r.toml \[regen\].base_url: a recipe file may not name it \(the "
        r"environment.s OPENAI_API_KEY is sent to it\); give it yourself with --set",
    ):
        validate(recipe, "r.toml")
    validate(recipe, "r.toml", overridden(["regen.base_url=http://127.0.0.1:1/v1"]))  # the user's own
    with pytest.raises(ValueError, match="offload_folder.*leads out of"):
        validate({"recipe": {"name": "r"}, "extract": {"offload_folder": "../outside"}}, "r.toml")
    with pytest.raises(ValueError, match=r"\[recipe\].out '.': the working folder itself"):
        recipe_out({"name": "r", "out": "."}, "r.toml")


def test_scale_and_only_do_what_they_say(tmp_path):
    """A count named twice in [scale] multiply was scaled twice; a count below one became 1
    (where the stage refuses it); --only "," ran every stage."""
    from eaglet.recipe import apply_scale, check_scale_paths, run_recipe

    with pytest.raises(ValueError, match=r"\[scale\].multiply: 'prepare.num_samples' named more than once"):
        check_scale_paths("r.toml", ["prepare.num_samples", "prepare.num_samples"])
    scaled = {"scale": {"multiply": ["prepare.num_samples"]}}
    assert apply_scale({**scaled, "prepare": {"num_samples": -3}}, 1.0)["prepare"]["num_samples"] == -3
    assert apply_scale({**scaled, "prepare": {"num_samples": 3}}, 0.01)["prepare"]["num_samples"] == 1
    with pytest.raises(ValueError, match="--only: no stage named"):
        run_recipe(RunOptions(spec="demo", out=tmp_path / "run", only=[]))
    assert not (tmp_path / "run").exists()
