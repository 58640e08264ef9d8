"""Each stage writes a folder of its own: one that holds another stage's output (marked, or by its
own files) is refused before anything is written, naming what is there, and so is an existing
file given as --out; a stage's folder says which kind of output it is."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from eaglet import formats
from eaglet.evaluate import evaluate
from eaglet.extract import extract
from eaglet.prepare import prepare
from eaglet.training.loop import train
from eaglet.options import (
    CheckOptions,
    ConvertOptions,
    EvalOptions,
    ExtractOptions,
    ImportOptions,
    PrepareOptions,
    RunOptions,
    TrainOptions,
)


@pytest.fixture
def outputs(tiny_target, chats_jsonl, tmp_path):
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "prepared"))
    extract(ExtractOptions(prepared=tmp_path / "prepared", out=tmp_path / "data", dtype="fp32"), show_progress=False)
    return tmp_path


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_each_output_folder_says_which_kind_it_is(outputs):
    assert (outputs / "prepared" / formats.OUTPUT_MARKER).read_text().strip() == "prepared dataset"
    assert (outputs / "data" / formats.OUTPUT_MARKER).read_text().strip() == "hidden-state dataset"


@pytest.mark.parametrize("stage", ["prepare", "extract", "train"])
def test_a_stage_refuses_another_stages_folder_and_leaves_it_whole(outputs, tiny_target, chats_jsonl, stage):
    """prepare into a dataset once overwrote its token_freq.pt; now nothing is written."""
    victim = Path(shutil.copytree(outputs / ("prepared" if stage == "extract" else "data"), outputs / "victim"))
    before = snapshot(victim)
    with pytest.raises(FileExistsError, match=r"holds another stage's output .*nothing was written"):
        if stage == "prepare":
            prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=victim))
        elif stage == "extract":
            extract(ExtractOptions(prepared=outputs / "prepared", out=victim, dtype="fp32"), show_progress=False)
        else:
            train(TrainOptions(dataset_dir=outputs / "data", out_dir=victim, total_steps=1), show_progress=False)
    assert snapshot(victim) == before


def test_an_unmarked_folder_is_known_by_its_files(outputs, tiny_target, chats_jsonl):
    (outputs / "data" / formats.OUTPUT_MARKER).unlink()  # a dataset written before markers
    with pytest.raises(FileExistsError, match=r"data_config.json, hidden_states"):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=outputs / "data"))


@pytest.mark.parametrize("stage", ["prepare", "extract", "convert", "train", "eval", "run", "export"])
def test_no_stage_writes_inside_a_dataset(outputs, tiny_target, chats_jsonl, stage):
    """An output inside a dataset's folder (an export into its rows folder, say) would leave files
    there that `eaglet check` then refuses as strays: refused, the dataset left whole and clean."""
    from eaglet.check import check_dataset
    from eaglet.export import export_drafter
    from eaglet.options import ExportOptions

    out = outputs / "data" / "hidden_states" / "rows_0-2000" / "new" / "out"
    before = snapshot(outputs / "data")
    with pytest.raises(FileExistsError, match=r"inside the (hidden-state dataset|dataset|source) .*data(,|:)"):
        if stage == "export":
            export_drafter(ExportOptions(ckpt=outputs / "nothing", out=out.with_suffix(".gguf"), fmt="gguf"))
        else:
            stage_run(stage, outputs, tiny_target, chats_jsonl, out)()
    assert snapshot(outputs / "data") == before and not out.parent.exists()  # no folder made either
    assert check_dataset(CheckOptions(path=outputs / "data", use_target=False)).clean


# What a user's folder may hold under a name a stage writes, by stage (a speculators dataset whose
# hidden_states/ is elsewhere lost its Arrow table to extract; a tool's own train_config.json was
# replaced by train's; an eval's vllm-drafter/ of the user's own was deleted)
USERS_FILES = {
    "prepare": ["token_freq.pt"],
    "extract": ["data_config.json", "state.json", "data-00000-of-00001.arrow"],
    "convert": ["sample_lengths.json"],
    "train": ["train_config.json"],
    "eval": ["vllm-drafter/notes"],
    "run": ["summary.json"],
}


def stage_run(stage, outputs, tiny_target, chats_jsonl, out):
    from eaglet.convert import convert
    from eaglet.recipe import run_recipe

    recipe = outputs / "r.toml"
    recipe.write_text('[recipe]\nname = "r"\n\n[prepare]\n')
    return {
        "prepare": lambda: prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=out)),
        "extract": lambda: extract(ExtractOptions(prepared=outputs / "prepared", out=out), show_progress=False),
        "convert": lambda: convert(
            ConvertOptions(src=outputs / "data", out=out, layout="compact"), show_progress=False
        ),
        "train": lambda: train(
            TrainOptions(dataset_dir=outputs / "data", out_dir=out, total_steps=1), show_progress=False
        ),
        "eval": lambda: evaluate(EvalOptions(drafter_path=outputs / "nothing", out=out)),
        "run": lambda: run_recipe(RunOptions(spec=recipe, out=out)),
    }[stage]


@pytest.mark.parametrize("stage", sorted(USERS_FILES))
def test_a_folder_no_stage_marked_keeps_the_files_a_stage_would_write(outputs, tiny_target, chats_jsonl, stage):
    folder = outputs / "users"
    for name in USERS_FILES[stage]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("the user's")
    before = snapshot(folder)
    with pytest.raises(
        FileExistsError,
        match=rf"--out .*users: holds .*{USERS_FILES[stage][0].split('/')[0]}.*, which "
        rf"no eaglet stage marked as its own .*`eaglet {stage}` would replace",
    ):
        stage_run(stage, outputs, tiny_target, chats_jsonl, folder)()
    assert snapshot(folder) == before and not (folder / formats.OUTPUT_MARKER).exists()


@pytest.mark.parametrize(
    "stage, name",
    [("eval", "llama-server-logs"), ("eval", "vllm-drafter"), ("extract", "hidden_states"), ("train", "metrics.jsonl")],
)
def test_a_link_where_a_stage_writes_is_refused_even_in_its_own_folder(outputs, tiny_target, chats_jsonl, stage, name):
    """eval wrote llama-server's logs through a link at OUT/llama-server-logs; an OUT/vllm-drafter
    link ended in a raw rmtree error."""
    folder, elsewhere = outputs / "own", outputs / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / formats.OUTPUT_MARKER).write_text(formats.io.OUTPUT_KINDS[stage] + "\n")
    (folder / name).symlink_to(elsewhere)
    with pytest.raises(
        FileExistsError,
        match=rf"own/{name}: a symbolic link \(to .*elsewhere\) where `eaglet {stage}` "
        rf"writes its own {name}",
    ):
        stage_run(stage, outputs, tiny_target, chats_jsonl, folder)()
    assert list(elsewhere.iterdir()) == []


def test_an_existing_file_as_out_is_refused(outputs, tiny_target, chats_jsonl):
    afile = outputs / "afile"
    afile.write_text("mine")
    for run in (
        lambda: prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=afile)),
        lambda: extract(ExtractOptions(prepared=outputs / "prepared", out=afile), show_progress=False),
        lambda: train(TrainOptions(dataset_dir=outputs / "data", out_dir=afile, total_steps=1), show_progress=False),
        lambda: evaluate(EvalOptions(drafter_path=outputs / "nothing", out=afile)),
    ):
        with pytest.raises(FileExistsError, match=r"--out .*afile: an existing file; `eaglet \w+` writes a folder"):
            run()
    assert afile.read_text() == "mine"


def test_an_out_through_a_dangling_link_is_named_as_one(outputs, tiny_target, chats_jsonl):
    """A link to nothing, as --out or above it, once gave a bare "File exists" or "Not a directory"."""
    link = outputs / "link"
    link.symlink_to(outputs / "nowhere")
    for out in (link, link / "below"):
        for run in (
            lambda: prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=out)),
            lambda: extract(ExtractOptions(prepared=outputs / "prepared", out=out), show_progress=False),
            lambda: train(TrainOptions(dataset_dir=outputs / "data", out_dir=out, total_steps=1), show_progress=False),
            lambda: evaluate(EvalOptions(drafter_path=outputs / "nothing", out=out)),
            lambda: formats.atomic_dir(out).__enter__(),
        ):
            with pytest.raises(
                FileExistsError,
                match=rf"{link} is a symbolic link to .*nowhere, which does not "
                "exist; create what it points to, remove the link",
            ):
                run()
    assert not (outputs / "nowhere").exists()


def test_paths_read_from_files_stay_inside_their_folder(tmp_path, monkeypatch):
    """A recipe's name or out, a weight index's shard: refused when they lead out of their folder."""
    from eaglet.recipe import run_recipe

    monkeypatch.chdir(tmp_path)
    for line, said in (
        ('name = "../../escaped"', r"\[recipe\]\.name '\.\./\.\./escaped': a plain name"),
        ('name = "x"\nout = "../../escaped"', r"\[recipe\]\.out: '\.\./\.\./escaped' leads out of"),
    ):
        recipe = tmp_path / "r.toml"
        recipe.write_text(f"[recipe]\n{line}\n\n[prepare]\n")
        with pytest.raises(ValueError, match=said):
            run_recipe(RunOptions(spec=recipe))
    assert not (tmp_path.parent.parent / "escaped").exists()
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"fc.weight": "../../secret.safetensors"}}')
    with pytest.raises(ValueError, match=r"'\.\./\.\./secret\.safetensors' leads out of"):
        formats.weight_files(folder)
    # an index of the wrong form is named, not a KeyError / AttributeError / TypeError
    for text in ('{"metadata": {}}', '{"weight_map": ["a", "b"]}', "[1, 2]", '{"weight_map": {"fc.weight": 7}}'):
        (folder / "model.safetensors.index.json").write_text(text)
        with pytest.raises(
            ValueError,
            match=r"model\.safetensors\.index\.json: no \"weight_map\" object of tensor "
            r"name -> shard file; the index is damaged",
        ):
            formats.weight_files(folder)


def test_a_targets_weight_index_stays_inside_its_folder(tiny_target, tmp_path):
    """A target's model.safetensors.index.json naming ../outside/w.safetensors (or an absolute path)
    had extract run on weights from outside the target's folder."""
    from eaglet.target import resolve_target

    for shard in ("../outside/w.safetensors", str(tmp_path / "outside" / "w.safetensors")):
        target = Path(shutil.copytree(tiny_target, tmp_path / "t", dirs_exist_ok=True))
        (target / "model.safetensors.index.json").write_text(
            '{"metadata": {}, "weight_map": {"lm_head.weight": "%s"}}' % shard
        )
        with pytest.raises(
            ValueError, match=r"model\.safetensors\.index\.json: a shard: .* (leads out of|is not a path)"
        ):
            resolve_target(str(target))
    # a Hugging Face cache snapshot: every file a link into the cache's blobs, the index naming the links
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in Path(tiny_target).iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f.name, snapshot))
    (snapshot / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"lm_head.weight": "model.safetensors"}}'
    )
    assert resolve_target(str(snapshot)).path == str(snapshot.resolve())


def test_a_hub_targets_cached_index_stays_inside_its_snapshot(tiny_target, tmp_path, monkeypatch):
    """A hub id whose cached index names ../ was refused by huggingface_hub in its own words,
    naming neither the index nor --target."""
    from eaglet.target import resolve_target

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_target, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert resolve_target("org/tiny").path == "org/tiny"  # the cached snapshot, as it came
    (snapshot / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"lm_head.weight": "../../../../outside.safetensors"}}'
    )
    with pytest.raises(
        ValueError, match=r"--target org/tiny: .*model\.safetensors\.index\.json: a shard: .* leads out of"
    ):
        resolve_target("org/tiny")


def test_a_target_without_its_tokenizer_is_named(tiny_target, tmp_path):
    """transformers said only "Couldn't instantiate the backend tokenizer", naming no folder."""
    from eaglet.target import load_tokenizer, resolve_target

    target = Path(shutil.copytree(tiny_target, tmp_path / "t"))
    (target / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"target .*t: its tokenizer cannot be built \(no readable tokenizer.json"):
        load_tokenizer(resolve_target(str(target)))


def test_written_files_honour_the_umask(outputs):
    """Files appear by rename from temp files (0600 as made); what a stage leaves is as the umask says."""
    for path in (
        outputs / "prepared" / "prepared.jsonl",
        outputs / "data" / formats.DATA_CONFIG_FILE,
        next((outputs / "data" / formats.HIDDEN_STATES_DIR).rglob("*.pt")),
    ):
        assert path.stat().st_mode & 0o777 == 0o666 & ~formats.io.current_umask(), path


def test_bounds_no_run_reaches_and_contradictory_options_are_refused(outputs):
    from eaglet.check.dataset import check_dataset
    from eaglet.recipe import apply_scale

    with pytest.raises(ValueError, match=r"--time-budget 1e\+30: must be in \(0, "):
        train(
            TrainOptions(dataset_dir=outputs / "data", out_dir=outputs / "run", time_budget=1e30), show_progress=False
        )
    with pytest.raises(ValueError, match=r"--scale 1e\+30: must be in \(0, "):
        apply_scale({}, 1e30)
    with pytest.raises(ValueError, match="--no-target skips them: give one"):
        check_dataset(CheckOptions(path=outputs / "data", target="some/model", use_target=False))


def test_extract_shards_of_another_count_exclude_each_other(outputs):
    """A run split into 2 shards writing the folder now keeps one split into 3 out of it."""
    out = outputs / "data"
    with formats.output_lock(out, "extract", lock=formats.lock_path(out, "shard-0-of-2")):
        with pytest.raises(formats.OutputBusy, match=r"--num-shards 2 is writing it now"):
            extract(
                ExtractOptions(prepared=outputs / "prepared", out=out, dtype="fp32", num_shards=3, shard_id=1),
                show_progress=False,
            )
        # the same count (another shard of the same run) goes ahead
        extract(
            ExtractOptions(prepared=outputs / "prepared", out=out, dtype="fp32", num_shards=2, shard_id=1),
            show_progress=False,
        )


def test_convert_and_an_extract_shard_exclude_each_other(tmp_path):
    """convert (the whole output's lock) and extract (a shard's lock) both wrote one --out: convert
    deleted extract's temp files as a killed run's leftovers."""
    out = tmp_path / "data"
    with formats.output_lock(out, "extract", lock=formats.lock_path(out, "shard-0-of-1")):
        with pytest.raises(formats.OutputBusy, match=r"another `eaglet extract` .* \(\.data\.shard-0-of-1\.lock\)"):
            with formats.output_lock(out, "convert"):
                pass
        with formats.output_lock(out, "extract", lock=formats.lock_path(out, "shard-1-of-2")):
            pass  # the shards of one extraction write side by side
    with formats.output_lock(out, "convert"):
        with pytest.raises(formats.OutputBusy, match=r"another `eaglet convert` .* \(\.data\.lock\)"):
            with formats.output_lock(out, "extract", lock=formats.lock_path(out, "shard-0-of-1")):
                pass
    with formats.output_lock(tmp_path / "data2", "convert"):  # another output whose name starts alike
        with formats.output_lock(out, "extract", lock=formats.lock_path(out, "shard-0-of-1")):
            pass


@pytest.mark.parametrize("kind", ["dangling link", "under a file", "under /proc"])
def test_an_offload_folder_that_cannot_be_one_is_said_plainly(tmp_path, kind):
    from eaglet.placement import placement_from_options

    if kind == "dangling link":
        folder = tmp_path / "link"
        folder.symlink_to(tmp_path / "nowhere")
        said = "does not exist"
    elif kind == "under a file":
        (tmp_path / "afile").write_text("x")
        folder, said = tmp_path / "afile" / "offload", "is a file"
    else:
        folder, said = "/proc/self/offload", "cannot be written"
    with pytest.raises(ValueError, match=rf"--offload-folder .*{said}"):
        placement_from_options("auto", offload_folder=str(folder))


def test_a_stage_marker_that_is_a_folder_is_named(tmp_path):
    (tmp_path / "x.json").mkdir()
    with pytest.raises(IsADirectoryError, match=r"x\.json: a folder where eaglet expects a JSON file"):
        formats.read_json(tmp_path / "x.json")


def test_a_refused_stage_leaves_no_marker_behind(outputs, tiny_target, chats_jsonl, tmp_path):
    """A folder of another stage without its marker (copied with `cp -r src/* dst/`) was refused,
    but marked with the refused stage's kind, so the same command was then accepted."""
    copied = tmp_path / "copied"
    copied.mkdir()
    for p in (outputs / "prepared").iterdir():
        if p.name != formats.OUTPUT_MARKER:
            (copied / p.name).write_bytes(p.read_bytes())
    for _ in range(2):
        with pytest.raises(FileExistsError, match="holds another stage's output"):
            extract(ExtractOptions(prepared=outputs / "prepared", out=copied), show_progress=False)
        assert not (copied / formats.OUTPUT_MARKER).exists()


def test_a_marker_copied_in_does_not_hide_another_stages_files(outputs, tmp_path):
    """The probe copied a dataset's marker into a prepared folder: extract then wrote its states
    beside the prepared files and kept their token_freq.pt as the dataset's."""
    forged = Path(shutil.copytree(outputs / "prepared", tmp_path / "forged"))
    shutil.copy(outputs / "data" / formats.OUTPUT_MARKER, forged / formats.OUTPUT_MARKER)
    before = snapshot(forged)
    with pytest.raises(FileExistsError, match=r"holds another stage's output \(prepared.jsonl, prepare_config.json\)"):
        extract(ExtractOptions(prepared=outputs / "prepared", out=forged), show_progress=False)
    assert snapshot(forged) == before


@pytest.mark.parametrize("stage", ["prepare", "extract", "train", "eval"])
def test_no_stage_writes_inside_a_runs_checkpoints(outputs, tiny_target, chats_jsonl, stage):
    """eval --out RUN/checkpoints put its results among the checkpoints a run prunes and resumes from."""
    run = outputs / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "train_config.json").write_text("{}")
    (run / formats.OUTPUT_MARKER).write_text("train run\n")
    for marked in (True, False):  # a run from before markers is known by its own files
        if not marked:
            (run / formats.OUTPUT_MARKER).unlink()
        before = snapshot(run)
        for out in (run / "checkpoints", run / "checkpoints" / "step_00000002" / "x"):
            with pytest.raises(FileExistsError, match=r"inside the train run .*run \(its checkpoints/\)"):
                stage_run(stage, outputs, tiny_target, chats_jsonl, out)()
        assert snapshot(run) == before


def test_an_output_that_holds_the_target_is_refused(tiny_target, chats_jsonl, tmp_path):
    target = Path(shutil.copytree(tiny_target, tmp_path / "w" / "target"))
    with pytest.raises(FileExistsError, match=r"--out .*w holds --target .*target: `eaglet prepare` writes"):
        prepare(PrepareOptions(target=str(target), data=str(chats_jsonl), out=tmp_path / "w"))


def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused(outputs, tiny_target, tmp_path):
    """prepare once replaced a chat file named prepared.jsonl in its --out; convert wrote into the
    source's parent or its hidden_states/; extract into the parent of its prepared folder."""
    chats = tmp_path / "x" / "prepared.jsonl"
    chats.parent.mkdir()
    chats.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')
    before = chats.read_bytes()
    with pytest.raises(
        FileExistsError,
        match=r"--out .*x holds --data .*prepared.jsonl: `eaglet prepare` writes a "
        "folder of its own",
    ):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats), out=chats.parent))
    assert chats.read_bytes() == before

    from eaglet.convert import convert

    data = outputs / "data"
    for out, where in (
        (data.parent, "holds the source"),
        (data / "hidden_states", "is inside the source"),
        (data, "is the source"),
    ):
        with pytest.raises(FileExistsError, match=rf"--out .* {where} "):
            convert(ConvertOptions(src=data, out=out, layout="speculators"), show_progress=False)
    with pytest.raises(FileExistsError, match="holds --prepared"):
        extract(ExtractOptions(prepared=outputs / "prepared", out=outputs), show_progress=False)
    with pytest.raises(FileExistsError, match="is inside the dataset"):
        train(TrainOptions(dataset_dir=data, out_dir=data / "run", total_steps=1), show_progress=False)


def test_extract_never_writes_through_a_link_into_another_dataset(outputs, tmp_path):
    """A hidden_states/ linked to another dataset's: its files were taken for damaged samples of
    this one and overwritten."""
    victim = outputs / "data" / "hidden_states"
    before = snapshot(victim)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "hidden_states").symlink_to(victim)
    with pytest.raises(FileExistsError, match="hidden_states: a symbolic link .* writes its own hidden_states"):
        extract(ExtractOptions(prepared=outputs / "prepared", out=linked), show_progress=False)
    assert snapshot(victim) == before


def test_an_out_under_a_file_and_a_folder_as_data_are_named(outputs, tiny_target, chats_jsonl):
    afile = outputs / "afile"
    afile.write_text("mine")
    with pytest.raises(FileExistsError, match=r"--out .*afile/sub: .*afile is a file, not a folder"):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=afile / "sub"))
    with pytest.raises(IsADirectoryError, match=r"--data .*prepared: a folder, not a chat file"):
        prepare(PrepareOptions(target=str(tiny_target), data=str(outputs / "prepared"), out=outputs / "p2"))


def test_whole_samples_of_other_shapes_are_never_overwritten(outputs, tmp_path):
    """Another dataset's rows_ folder linked into this one: its files were taken for damaged
    samples and rewritten by extract (and by convert)."""
    import torch

    data = Path(shutil.copytree(outputs / "data", tmp_path / "copy"))
    sample = formats.sample_path(data, formats.V1_LAYOUT, 1)
    other = [torch.randn(3, 64, dtype=torch.bfloat16) for _ in range(4)]
    formats.write_sample(
        tmp_path / "other", formats.V1_LAYOUT, 1, torch.arange(3), other, torch.ones(3, dtype=torch.long)
    )
    sample.write_bytes(formats.sample_path(tmp_path / "other", formats.V1_LAYOUT, 1).read_bytes())
    before = sample.read_bytes()
    with pytest.raises(FileExistsError, match=r"data_1.pt: a whole sample of other shapes .*another dataset's file"):
        extract(ExtractOptions(prepared=outputs / "prepared", out=data, dtype="fp32"), show_progress=False)
    assert sample.read_bytes() == before


def test_train_keeps_to_checkpoints_of_its_own(outputs, tmp_path):
    """--resume into a folder whose checkpoints/ links to another run's pruned that run."""
    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=outputs / "data", out_dir=run, total_steps=1), show_progress=False)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "checkpoints").symlink_to(run / "checkpoints")
    before = snapshot(run / "checkpoints")
    with pytest.raises(FileExistsError, match="checkpoints: a symbolic link"):
        train(
            TrainOptions(dataset_dir=outputs / "data", out_dir=linked, total_steps=2, resume=True), show_progress=False
        )
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copytree(run / "checkpoints", copied / "checkpoints")
    with pytest.raises(FileExistsError, match="holds checkpoints, which no eaglet stage marked as its own"):
        train(
            TrainOptions(dataset_dir=outputs / "data", out_dir=copied, total_steps=2, resume=True), show_progress=False
        )
    assert snapshot(run / "checkpoints") == before


def test_prepare_replaces_only_its_own_samples(outputs, tiny_target, chats_jsonl, tmp_path):
    """A folder holding the user's own prepared.jsonl (no prepare_config.json) was replaced with a warning."""
    folder = tmp_path / "y"
    folder.mkdir()
    (folder / "prepared.jsonl").write_text('{"my": "notes"}\n')
    (folder / formats.OUTPUT_MARKER).write_text("prepared dataset\n")  # in a prepared dataset's folder even
    with pytest.raises(FileExistsError, match=r"prepared.jsonl: not a prepared dataset's file"):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=folder))
    assert (folder / "prepared.jsonl").read_text() == '{"my": "notes"}\n'


def test_eval_replaces_only_its_own_drafters_results(outputs, tmp_path):
    """Another drafter's eval.json and eval.png were overwritten unseen."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "eval.json").write_text('{"config": {"drafter": "/elsewhere/other-run"}, "sets": {}}')
    (results / formats.OUTPUT_MARKER).write_text("eval results\n")
    with pytest.raises(
        FileExistsError, match=r"eval.json holds the results of another drafter, '/elsewhere/other-run'"
    ):
        evaluate(EvalOptions(drafter_path=outputs / "run", out=results))
    assert "other-run" in (results / "eval.json").read_text()


def test_side_files_and_folders_of_the_wrong_kind_are_named(tmp_path):
    """A sample_lengths.json list once ended train in AttributeError; an export onto a link to an
    empty folder in a bare "Not a directory"."""
    lengths = tmp_path / "sample_lengths.json"
    lengths.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"sample_lengths.json: expected \{\"sample index\": tokens"):
        formats.read_sample_lengths(lengths)
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(FileExistsError, match="link: a symbolic link"):
        with formats.atomic_dir(tmp_path / "link"):
            pass


def test_import_writes_apart_from_the_folder_it_reads(tmp_path):
    from eaglet.export import import_drafter

    (tmp_path / "drafter").mkdir()
    for out, where in ((tmp_path / "drafter", "is"), (tmp_path, "holds")):
        with pytest.raises(FileExistsError, match=f"{where} the drafter folder"):
            import_drafter(ImportOptions(src=tmp_path / "drafter", out=out))
