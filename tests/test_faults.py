"""Faults at the command line: a full disk, a read-only folder, a damaged target config, an
unexpected error. Each ends in one line on stderr that names the file and what to do, exit 2,
no traceback (unless -v), and nothing half-written; the same command then resumes."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from eaglet import formats
from eaglet.cli import main
from eaglet.evaluate import prompt_sets_by_name
from eaglet.formats.prepared import scan_output
from eaglet.placement import placement_from_options
from eaglet.vllm_engine import parse_engine_args
from eaglet.prepare import prepare
from eaglet.formats import io as formats_io  # where writes look up free space and make their temp files
from eaglet.options import CheckOptions, EvalOptions, ExtractOptions, PrepareOptions, RegenOptions


def run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def assert_one_line(err: str, *words: str) -> None:
    lines = re.findall(r"eaglet \w+: error: .*", err)  # a progress bar may share its line
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


# The tiny target holds 1024 positions: prepare refuses a longer --max-length.
FITS = ("--max-length", "512")


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if formats.TMP_MARK in p.name]


@pytest.fixture
def prepared(tiny_target, chats_jsonl, tmp_path) -> Path:
    assert (
        main(
            [
                "prepare",
                "--data",
                str(chats_jsonl),
                "--out",
                str(tmp_path / "prep"),
                "--target",
                str(tiny_target),
                *FITS,
            ]
        )
        == 0
    )
    return tmp_path / "prep"


def test_disk_full_during_extract_names_the_file_and_the_rerun_resumes(
    tiny_target, prepared, tmp_path, capsys, monkeypatch
):
    """torch.save on a full disk says only "[enforce fail at inline_container.cc] unexpected pos"."""
    out = tmp_path / "data"
    real_save, saves = torch.save, []

    def save_until_full(obj, f, *a, **k):
        saves.append(f)
        if len(saves) > 3:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 320 vs 0")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_full)
    monkeypatch.setattr(formats_io, "disk_nearly_full", lambda folder: len(saves) > 3)
    rc, err = run(capsys, "extract", "--prepared", str(prepared), "--out", str(out), "--target", str(tiny_target))
    assert rc == 2
    assert_one_line(err, "could not write", "rows_0-2000/data_", "no space left", "run the same command again")
    assert not temp_files(out) and 0 < len(formats.list_v1_files(out)) < 12  # the finished ones are kept
    monkeypatch.undo()
    rc, _ = run(capsys, "extract", "--prepared", str(prepared), "--out", str(out), "--target", str(tiny_target))
    assert rc == 0 and len(formats.list_v1_files(out)) == 12 and not temp_files(out)


def test_disk_full_during_prepare_keeps_nothing_half_written(tiny_target, chats_jsonl, tmp_path, capsys, monkeypatch):
    def full(self, sample):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(formats.PreparedWriter, "add", full)
    out = tmp_path / "prep"
    out.mkdir()
    (out / f".{formats.PREPARED_FILE}{formats.TMP_MARK}killed").write_text("an earlier run's half")
    rc, err = run(capsys, "prepare", "--data", str(chats_jsonl), "--out", str(out), "--target", str(tiny_target), *FITS)
    assert rc == 2
    assert_one_line(err, f"could not write {out / formats.PREPARED_FILE}", "no space left")
    assert not temp_files(out) and not (out / formats.PREPARE_CONFIG_FILE).exists()


def test_read_only_output_folder(tiny_target, chats_jsonl, tmp_path, capsys, monkeypatch):
    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(formats_io.tempfile, "mkstemp", read_only)
    rc, err = run(
        capsys,
        "prepare",
        "--data",
        str(chats_jsonl),
        "--out",
        str(tmp_path / "prep"),
        "--target",
        str(tiny_target),
        *FITS,
    )
    assert rc == 2
    assert_one_line(err, str(tmp_path / "prep"), "read-only file system", "another folder")


def test_a_folder_that_cannot_be_created_is_named(tiny_target, prepared, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should go")
    rc, err = run(
        capsys, "extract", "--prepared", str(prepared), "--out", str(blocker / "data"), "--target", str(tiny_target)
    )
    assert rc == 2
    assert_one_line(err, str(blocker))


@pytest.mark.parametrize(
    "config_text, words",
    [('{"model_type": "llama", "hidden_si', ("not valid JSON",)), ('{"hidden_size": 64}', ("model_type",))],
)
def test_damaged_target_config(tiny_target, chats_jsonl, tmp_path, capsys, config_text, words):
    target = Path(shutil.copytree(tiny_target, tmp_path / "target"))
    (target / "config.json").write_text(config_text)
    for argv in (
        ["prepare", "--data", str(chats_jsonl), "--out", str(tmp_path / "prep")],
        ["regen", "--data", str(chats_jsonl), "--out", str(tmp_path / "regen.jsonl")],
    ):
        rc, err = run(capsys, *argv, "--target", str(target))
        assert rc == 2
        assert_one_line(err, str(target / "config.json"), *words)


def test_unexpected_error_is_one_line_unless_verbose(chats_jsonl, tmp_path, capsys, monkeypatch):
    import eaglet.prepare

    def bug(*a, **k):
        raise KeyError("messages")

    monkeypatch.setattr(eaglet.prepare, "prepare", bug)
    rc, err = run(capsys, "prepare", "--data", str(chats_jsonl), "--out", str(tmp_path / "p"))
    assert rc == 2
    assert_one_line(err, "KeyError", "'messages'", "-v")
    with pytest.raises(KeyError):
        main(["-v", "prepare", "--data", str(chats_jsonl), "--out", str(tmp_path / "p")])


def bad_option_calls():
    from eaglet.check import check_dataset
    from eaglet.evaluate import DecodeSettings, evaluate
    from eaglet.extract import extract
    from eaglet.regen import regenerate

    return [
        (lambda: extract(ExtractOptions(prepared="p", out="o", batch_tokens=0)), "--batch-tokens 0: must be >= 1"),
        (
            lambda: extract(ExtractOptions(prepared="p", out="o", max_batch_size=-1)),
            "--max-batch-size -1: must be >= 1",
        ),
        (lambda: regenerate(RegenOptions(data="d", out="o.jsonl", top_p=0.0)), r"--top-p 0.0: must be in \(0, 1\]"),
        (
            lambda: regenerate(RegenOptions(data="d", out="o.jsonl", max_new_tokens=0)),
            "--max-new-tokens 0: must be >= 1",
        ),
        (lambda: regenerate(RegenOptions(data="d", out="o.jsonl", temperature=-1)), "--temperature -1: must be >= 0"),
        (lambda: evaluate(EvalOptions(drafter_path="d", num_prompts=0)), "--num-prompts 0: must be >= 1"),
        (lambda: DecodeSettings(chain_depth=0), "--chain-depth 0: must be >= 1"),
        (lambda: DecodeSettings(min_draft_prob=1.5), r"--min-draft-prob 1.5: must be in \[0, 1\]"),
        (lambda: check_dataset(CheckOptions(path="d", identity_samples=-1)), "--identity-samples -1: must be >= 0"),
        (lambda: check_dataset(CheckOptions(path="d", workers=0)), "--workers 0: must be >= 1"),
    ]


def test_numeric_options_are_checked_by_each_stage_entry_function():
    """Before any file is read: the same error from the command line, a recipe or Python."""
    for call, message in bad_option_calls():
        with pytest.raises(ValueError, match=f"^{message}"):
            call()


def test_token_id_outside_the_vocabulary_names_the_sample_and_the_fixed_input_reruns(
    tiny_target, prepared, tmp_path, capsys
):
    """Once "IndexError: index out of range in self", with a data_config.json left that refused the rerun."""
    import json

    path = prepared / formats.PREPARED_FILE
    good = path.read_text()
    records = [json.loads(line) for line in good.splitlines()]
    records[4]["input_ids"][2] = 100_000
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ("extract", "--prepared", str(prepared), "--out", str(tmp_path / "data"), "--target", str(tiny_target))
    rc, err = run(capsys, *argv)
    assert rc == 2
    assert_one_line(err, f"{path}:5: sample chat4: token id 100000", "vocabulary of 400", "prepare the data again")
    path.write_text(good)
    rc, _ = run(capsys, *argv)
    assert rc == 0 and len(formats.list_v1_files(tmp_path / "data")) == 12


def test_a_target_weight_file_cut_short_is_named_by_extract(tiny_target, chats_jsonl, tmp_path, capsys):
    """A safetensors header that claims bytes past the end of the file: the file and the remedy,
    not the safetensors reader's own words."""
    target = Path(shutil.copytree(tiny_target, tmp_path / "target"))
    weights = target / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
    prepared = tmp_path / "prep"  # prepare reads the tokenizer only: the cut-off weights pass
    assert main(["prepare", "--data", str(chats_jsonl), "--out", str(prepared), "--target", str(target), *FITS]) == 0
    rc, err = run(
        capsys, "extract", "--prepared", str(prepared), "--out", str(tmp_path / "data"), "--target", str(target)
    )
    assert rc == 2
    assert_one_line(err, f"{weights}: truncated: tensor", "ends at byte", "download or copy it again")
    assert not (tmp_path / "data" / "rows_0-2000").exists()


def test_a_full_disk_inside_safetensors_names_the_file(tmp_path, monkeypatch):
    """safetensors reports a full disk in its own words only ("... os error 28"): the write is named
    like any other, with the remedy."""

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(formats_io, "save_file", full)
    with pytest.raises(formats_io.WriteFailed, match=r"could not write .*w\.safetensors: no space left on the device"):
        formats_io.write_safetensors_atomic(tmp_path / "w.safetensors", {"x": torch.zeros(2)})
    assert not temp_files(tmp_path)


def test_a_json_line_nested_too_deep_is_skipped_and_counted(tiny_target, chats_jsonl, tmp_path):
    data = tmp_path / "deep.jsonl"
    data.write_text(chats_jsonl.read_text() + '{"id": "deep", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    summary = prepare(PrepareOptions(target=str(tiny_target), data=str(data), out=tmp_path / "prep", max_length=512))
    assert summary.samples == len(chats_jsonl.read_text().splitlines())


DEEP = "[" * 100_000 + "]" * 100_000  # beyond what Python's JSON parser recurses into


def test_json_nested_too_deep_is_named_with_its_file_by_every_reader(tmp_path):
    """A checkpoint pointer, sample_lengths.json, prepare_config.json, a prepared line, metrics.jsonl,
    a regen output line or an eval prompts file nested 100,000 deep each ended in "maximum recursion
    depth exceeded" without a file: every reader names it, as it names any damaged JSON."""

    def deep(name: str, text: str = DEEP + "\n") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    readers = [
        (lambda: formats.read_json(deep("best.json")), r"best\.json: not valid JSON \(maximum recursion depth"),
        (lambda: formats.read_jsonl_log(deep("metrics.jsonl")), r"metrics\.jsonl:1: not a JSON line \(maximum"),
        (
            lambda: formats.TokenizedSample.from_json(DEEP, "prepared.jsonl:3"),
            r"prepared\.jsonl:3: not a prepared sample \(RecursionError",
        ),
        (lambda: scan_output(deep("chats.jsonl")), r"chats\.jsonl:1: not a regen record \(RecursionError"),
        (lambda: prompt_sets_by_name([str(deep("prompts.jsonl"))], None), r"prompts\.jsonl.*invalid JSON \(maximum"),
        (lambda: placement_from_options(str(deep("map.json")), None, None, None), r"map\.json: not valid JSON"),
        (lambda: parse_engine_args(DEEP), r"--vllm-args '\[\[\[.*: not JSON \(maximum recursion depth"),
    ]
    for read, message in readers:
        with pytest.raises(ValueError, match=message):
            read()


def test_an_out_under_a_pseudo_filesystem_is_not_called_a_full_disk(tiny_target, chats_jsonl, capsys):
    rc, err = run(
        capsys, "prepare", "--data", str(chats_jsonl), "--out", "/proc/eaglet-out", "--target", str(tiny_target), *FITS
    )
    assert rc == 2
    assert_one_line(err, "/proc/")
    assert "no space" not in err


def test_token_counts_that_are_not_whole_numbers_name_the_file(tmp_path):
    path = tmp_path / formats.TOKEN_FREQ_FILE
    torch.save({5: float("nan")}, path)
    with pytest.raises(ValueError, match=rf"^{path}: expected a dict .* of whole numbers"):
        formats.read_token_freq(path)


@pytest.mark.parametrize(
    "text, said",
    [
        ('{"lr": "abc"}', r" \(--lr 'abc': must be a number > 0;"),
        ('{"ttt_steps": true}', r" \(--ttt-steps True: must be a whole number;"),
        (
            '{"aux_layer_ids": [2, "4", 5]}',
            r" \(--aux-layer-ids \[2, '4', 5\]: must be "
            r"a list of whole numbers;",
        ),
    ],
)
def test_a_resumed_run_whose_config_file_is_damaged_names_it(tmp_path, text, said):
    """A value of the wrong kind in the file (a bool for a count) was accepted on resume."""
    from eaglet.training.loop import options_of_run

    (tmp_path / "train_config.json").write_text(text)
    with pytest.raises(
        ValueError, match=r"train_config\.json: the run's settings do not make a training config" + said
    ):
        options_of_run(tmp_path, True, {})


def test_a_resumed_runs_own_setting_is_named_as_the_runs_not_the_command_lines(tmp_path):
    """train_config.json's draft_vocab_size 10^9 or aux ids [1, 2] were refused as if given on the
    command line; its offload_folder was taken as where to write weights."""
    from eaglet.training.loop import options_of_run, run_settings_named

    (tmp_path / "train_config.json").write_text(
        '{"draft_vocab_size": 1000000000, "aux_layer_ids": [1, 2], "offload_folder": "/elsewhere", "lr": 0.01}'
    )
    cfg, from_run = options_of_run(tmp_path, True, {"lr": 0.5})
    assert cfg.offload_folder is None and cfg.lr == 0.5 and from_run == {"draft_vocab_size", "aux_layer_ids"}
    for message, named in (
        ("draft_vocab_size 1000000000 must be in [1, 49152]", "draft_vocab_size"),
        ("--aux-layer-ids [1, 2]: 3 ids", "aux_layer_ids"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"^{re.escape(message)} \({named}: this run's own setting, which "
            rf"--resume read from .*train_config\.json; fix the file",
        ):
            with run_settings_named(tmp_path, from_run):
                raise ValueError(message)
    with pytest.raises(ValueError, match=r"^--lr 0.5 is too high$"):  # given now: the message stands
        with run_settings_named(tmp_path, from_run):
            raise ValueError("--lr 0.5 is too high")


def test_a_damaged_json_file_of_the_target_is_named(tiny_target, tmp_path):
    """A cut-off tokenizer.json once ended prepare with the JSON parser's words alone."""
    from eaglet.target import load_tokenizer, resolve_target

    folder = Path(shutil.copytree(tiny_target, tmp_path / "target"))
    (folder / "tokenizer.json").write_bytes((tiny_target / "tokenizer.json").read_bytes()[:500])
    with pytest.raises(ValueError, match=r"tokenizer.json is damaged \(.*\); download or copy it again"):
        load_tokenizer(resolve_target(str(folder)))
