"""A train run folder has one writer, its pointers always name complete checkpoints, and a run
never continues on other data, layer ids the states do not match, or positions it cannot train;
eval and check say so when the target is not the one the drafter or data came from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tiny_llama, write_jsonl
from eaglet import check as C
from eaglet.check import files as check_files
from eaglet.check import identity as check_identity
from eaglet import formats
from eaglet.cli import main as cli_main
from eaglet.prepare import prepare
from eaglet.extract import extract
from eaglet.formats.runs import BEST_FILE, CHECKPOINTS_DIR, DRAFTER_CONFIG_FILE, LATEST_FILE, MODEL_FILE, STATE_FILE
from eaglet.training.checkpoints import RunFolderBusy, prune_checkpoints, truncate_metrics
from eaglet.training.loop import train
from helpers import chat_records
from eaglet.options import (
    CheckOptions,
    ConvertOptions,
    ExportOptions,
    ExtractOptions,
    ImportOptions,
    PrepareOptions,
    TrainOptions,
)

QUICK = dict(total_steps=4, ttt_steps=2, eval_every=2, log_every=1, batch_size=2, eval_fraction=0.2)


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("run_folder")
    prepare(
        PrepareOptions(
            target=str(tiny_target),
            data=str(write_jsonl(work / "chats.jsonl", chat_records(12))),
            out=work / "prep",
            max_length=256,
        )
    )
    extract(ExtractOptions(prepared=work / "prep", out=work / "v1", target=str(tiny_target)), show_progress=False)
    return work


@pytest.fixture(scope="module")
def other_target(tiny_target, tmp_path_factory) -> Path:
    """The tiny target's architecture and tokenizer with other random weights: same shapes, other revision."""
    folder = tmp_path_factory.mktemp("other_target")
    for f in tiny_target.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    make_tiny_llama(folder, formats.read_json(tiny_target / "config.json")["vocab_size"], seed=1)
    return folder


def pointers_name_complete_checkpoints(run: Path) -> bool:
    root = run / CHECKPOINTS_DIR
    named = [formats.read_json(root / p)["path"] for p in (BEST_FILE, LATEST_FILE) if (root / p).exists()]
    return all((root / name / formats.DRAFTER_WEIGHTS_FILE).exists() for name in named)


def test_a_run_folder_has_one_writer_and_a_killed_one_leaves_no_lock(data, tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from eaglet.training.checkpoints import run_lock\n"
            f"with run_lock(Path({str(run)!r})):\n    print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            RunFolderBusy,
            match=rf"{run}: another `eaglet train` \(pid {holder.pid} on .*\) is "
            r"writing this run folder; wait for it to end, or train into",
        ):
            train(TrainOptions(dataset_dir=data / "v1", out_dir=run, **QUICK), show_progress=False)
        assert not (run / CHECKPOINTS_DIR).exists()  # refused before touching anything
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs, the kernel drops the lock
        holder.wait()
    summary = train(TrainOptions(dataset_dir=data / "v1", out_dir=run, **QUICK), show_progress=False)
    assert summary.step == 4 and pointers_name_complete_checkpoints(run)


def test_interrupt_while_saving_leaves_pointers_to_complete_checkpoints(data, tmp_path, monkeypatch):
    import eaglet.training.checkpoints as T
    from eaglet.export import export_drafter

    real, calls = T.save_checkpoint, []

    def interrupted_on_second_save(ckpt_root, step, *a, **k):
        calls.append(step)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C between the held-out eval (a new best) and its checkpoint
        return real(ckpt_root, step, *a, **k)

    monkeypatch.setattr(T, "save_checkpoint", interrupted_on_second_save)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(TrainOptions(dataset_dir=data / "v1", out_dir=run, **QUICK), show_progress=False)
    assert calls == [2, 4] and pointers_name_complete_checkpoints(run)
    assert formats.read_json(run / CHECKPOINTS_DIR / BEST_FILE)["step"] == 2  # the new best was never saved
    export_drafter(
        ExportOptions(ckpt=run, out=tmp_path / "export", fmt="eagle")
    )  # export and eval of RUN work as they are
    monkeypatch.setattr(T, "save_checkpoint", real)
    assert train(TrainOptions(dataset_dir=data / "v1", out_dir=run, resume=True), show_progress=False).step == 4


def test_a_pointer_to_a_missing_checkpoint_is_named(data, tmp_path, capsys):
    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=data / "v1", out_dir=run, **QUICK), show_progress=False)
    best = formats.read_json(run / CHECKPOINTS_DIR / BEST_FILE)["path"]
    shutil.rmtree(run / CHECKPOINTS_DIR / best)
    assert cli_main(["export", str(run), str(tmp_path / "out"), "--format", "eagle"]) == 2
    err = capsys.readouterr().err
    assert f"{run / CHECKPOINTS_DIR / BEST_FILE}: names {best}, which is not a complete checkpoint" in err
    assert "--resume` rewrites the pointers" in err


def test_resume_refuses_other_data(data, tiny_target, tmp_path):
    from eaglet.convert import convert

    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=data / "v1", out_dir=run, stop_after=2, **QUICK), show_progress=False)
    other = tmp_path / "other"  # the same target, other chats
    prepare(
        PrepareOptions(
            target=str(tiny_target),
            data=str(write_jsonl(tmp_path / "c.jsonl", chat_records(14)[2:])),
            out=tmp_path / "p",
            max_length=256,
        )
    )
    extract(ExtractOptions(prepared=tmp_path / "p", out=other, target=str(tiny_target)), show_progress=False)
    v1 = formats.FORMAT_V1
    with pytest.raises(
        ValueError,
        match=rf"--resume: .*step_00000002 was trained on {data / 'v1'} \({v1} layout, 12 "
        rf"samples\); {other} is other data \({v1} layout, 12 samples, other samples\)",
    ):
        train(TrainOptions(dataset_dir=other, out_dir=run, resume=True), show_progress=False)
    # the same samples, other stored values
    convert(ConvertOptions(src=data / "v1", out=tmp_path / "cmp", layout="compact", stored_top_k=16))
    said = rf"is other data \({formats.FORMAT_COMPACT} layout, 12 samples\), and the run.s held-out"
    with pytest.raises(ValueError, match=said):
        train(TrainOptions(dataset_dir=tmp_path / "cmp", out_dir=run, resume=True), show_progress=False)
    moved = Path(shutil.copytree(data / "v1", tmp_path / "moved"))  # a moved copy is the same data
    assert train(TrainOptions(dataset_dir=moved, out_dir=run, resume=True), show_progress=False).step == 4


def test_train_refuses_layer_ids_the_states_do_not_match(data, tmp_path):
    edited = Path(shutil.copytree(data / "v1", tmp_path / "edited"))
    cfg = formats.read_json(edited / formats.DATA_CONFIG_FILE)
    cfg["layer_ids"] = [3, 4, 5, 8]  # the files hold 2, 4, 5 (the tiny target's 2, N//2, N-3)
    cfg["aux_layer_ids"] = [3, 4, 5]  # edited as one fact (check names the two records disagreeing otherwise)
    formats.write_json_atomic(edited / formats.DATA_CONFIG_FILE, cfg)
    with pytest.raises(
        ValueError,
        match=r"data_config.json: layer_ids \[3, 4, 5, 8\] do not match the stored states "
        r"\(slot 0 matches layer 2.*`eaglet check .* --target T`",
    ):
        train(TrainOptions(dataset_dir=edited, out_dir=tmp_path / "run", **QUICK), show_progress=False)
    assert not (tmp_path / "run" / CHECKPOINTS_DIR).exists()


def test_train_names_a_pipe_where_a_sample_file_should_be(data, tmp_path):
    """It said only "27 sample files, data_config.json says 26; rerun extract", which did not help."""
    import os

    edited = Path(shutil.copytree(data / "v1", tmp_path / "edited"))
    fifo = next((edited / formats.HIDDEN_STATES_DIR).iterdir()) / "data_999.pt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=rf"{fifo}: a pipe, socket or device where a sample file should be"):
        train(TrainOptions(dataset_dir=edited, out_dir=tmp_path / "run", **QUICK), show_progress=False)


def test_train_refuses_a_dataset_of_another_chat_template(data, tmp_path):
    """check with the target refused it; train trained on it."""
    edited = Path(shutil.copytree(data / "v1", tmp_path / "edited"))
    cfg = formats.read_json(edited / formats.DATA_CONFIG_FILE)
    formats.write_json_atomic(edited / formats.DATA_CONFIG_FILE, {**cfg, "chat_template_sha256": "ffffffffffffffff"})
    with pytest.raises(ValueError, match=r"data_config.json: chat_template_sha256 ffffffffffffffff is not the target"):
        train(TrainOptions(dataset_dir=edited, out_dir=tmp_path / "run", **QUICK), show_progress=False)
    assert not (tmp_path / "run" / CHECKPOINTS_DIR).exists()


@pytest.mark.parametrize("max_length", [1, 2, 3])
def test_max_length_that_leaves_no_position_is_refused(max_length, data, tmp_path, capsys):
    code = cli_main(
        [
            "train",
            str(data / "v1"),
            "--out",
            str(tmp_path / "run"),
            "--ttt-steps",
            "2",
            "--max-length",
            str(max_length),
            "--total-steps",
            "2",
        ]
    )
    assert code == 2
    assert (
        f"--max-length {max_length}: TTT step k at position t predicts token t+k+2, so with --ttt-steps 2 a "
        "sample needs at least 4 tokens"
    ) in capsys.readouterr().err
    assert not (tmp_path / "run" / CHECKPOINTS_DIR).exists()


def test_an_evaluation_over_no_position_is_never_the_best(data, tmp_path, monkeypatch):
    """Held-out samples whose masks hold nothing to score give acc 0 and no loss (null, not NaN)."""
    import eaglet.training.loop as T

    real = T.evaluate

    def nothing_scored(*a, **k):
        r = real(*a, **k)
        return {**r, "positions": [0.0] * len(r["positions"]), "acc": [0.0] * len(r["acc"]), "tau": 0.0}

    monkeypatch.setattr(T, "evaluate", nothing_scored)
    run = tmp_path / "run"
    summary = train(TrainOptions(dataset_dir=data / "v1", out_dir=run, **QUICK), show_progress=False)
    assert summary.best_step is None and not (run / CHECKPOINTS_DIR / BEST_FILE).exists()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert "NaN" not in "".join(lines) and all(json.loads(line) for line in lines)


def test_non_finite_loss_stops_the_run(data, tmp_path, monkeypatch):
    import eaglet.training.loop as T

    real = T.forward_stats
    monkeypatch.setattr(T, "forward_stats", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    with pytest.raises(FloatingPointError, match=r"step 1: the loss is nan on samples \[.*\]; the weights before"):
        train(TrainOptions(dataset_dir=data / "v1", out_dir=tmp_path / "run", **QUICK), show_progress=False)


def test_eval_refuses_a_target_of_other_weights(data, other_target, tmp_path, capsys):
    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=data / "v1", out_dir=run, **QUICK), show_progress=False)
    args = [
        "eval",
        str(run),
        "--target",
        str(other_target),
        "--methods",
        "chain",
        "--prompts",
        str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello there"}])),
        "--max-new-tokens",
        "4",
        "--dtype",
        "fp32",
        "--no-plot",
    ]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "trained for a target of revision" in err and f"--target {other_target.resolve()} has revision" in err
    assert "--other-target to measure it on this one anyway" in err
    assert cli_main([*args, "--other-target"]) == 0


def test_check_names_the_other_revision_first(data, other_target):
    report = C.check_dataset(CheckOptions(path=data / "v1", target=str(other_target)))
    assert not report.clean
    first = next(p for p in report.problems if p.kind == C.LAYER_IDENTITY)
    assert (
        first.path == formats.DATA_CONFIG_FILE and "is not the revision of the target checked against" in first.message
    )
    assert C.check_dataset(CheckOptions(path=data / "v1")).clean  # its own recorded target


def test_both_paths_of_auto_run_on_any_machine(data, tiny_target, tmp_path, monkeypatch, auto_is_bf16):
    """`auto` as on a CPU with bf16 matrix units: extraction computes in bf16, the check with the
    target (recomputing in the recorded dtype) is clean, training autocasts to bf16."""
    extract(ExtractOptions(prepared=data / "prep", out=tmp_path / "bf16", target=str(tiny_target)), show_progress=False)
    assert formats.read_json(tmp_path / "bf16" / formats.DATA_CONFIG_FILE)["compute_dtype"] == "bfloat16"
    report = C.check_dataset(CheckOptions(path=tmp_path / "bf16", target=str(tiny_target)))
    assert report.clean, report.lines()
    bf16 = train(TrainOptions(dataset_dir=tmp_path / "bf16", out_dir=tmp_path / "run", **QUICK), show_progress=False)
    assert formats.read_json(tmp_path / "run" / "train_config.json")["bf16"] is True
    monkeypatch.setenv("EAGLET_CPU_FAST_BF16", "0")
    extract(ExtractOptions(prepared=data / "prep", out=tmp_path / "fp32", target=str(tiny_target)), show_progress=False)
    assert formats.read_json(tmp_path / "fp32" / formats.DATA_CONFIG_FILE)["compute_dtype"] == "float32"
    fp32 = train(TrainOptions(dataset_dir=tmp_path / "fp32", out_dir=tmp_path / "run32", **QUICK), show_progress=False)
    assert formats.read_json(tmp_path / "run32" / "train_config.json")["bf16"] is False
    # Both held out the same positions; the bf16 run's held-out loss is the fp32 run's within bf16's
    # rounding (2e-4 apart here), and not bit-equal: that run computed in bf16.
    ev16, ev32 = bf16.last_eval, fp32.last_eval
    assert ev16 and ev32 and ev16["positions"] == ev32["positions"] and ev16["positions"][0] > 0
    assert ev16["loss"] == pytest.approx(ev32["loss"], rel=5e-3) and ev16["loss"] != ev32["loss"]


def test_samples_longer_than_the_target_are_refused_by_train_and_check(data):
    """A prepared --max-length beyond the target's positions gives states the target never makes in use."""
    from types import SimpleNamespace

    from eaglet.training.data import Source, refuse_beyond_positions

    short = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=16))
    src = Source(data / "v1", {0: 10, 1: 40, 2: 20}, {}, [2, 4, 5], "pre_norm", "bfloat16", lambda i: None, True)
    with pytest.raises(
        ValueError,
        match=rf"{data / 'v1'}: sample 1 has 40 tokens and 2 sample\(s\) in all are longer "
        r"than the target's 16 positions \(max_position_embeddings\); pass "
        r"--max-length 16 or less",
    ):
        refuse_beyond_positions(src, None, short.config)
    refuse_beyond_positions(src, 16, short.config)  # truncated to fit: trains
    results = [check_files.FileResult(0, "a.pt", 0, length=10), check_files.FileResult(1, "b.pt", 0, length=40)]
    assert [(p.kind, p.path) for p in check_identity.too_long_problems(results, short)] == [(C.TOO_LONG, "b.pt")]


def test_online_refuses_token_ids_outside_the_vocabulary(data, tmp_path):
    prep = Path(shutil.copytree(data / "prep", tmp_path / "prep"))
    path = prep / formats.PREPARED_FILE
    lines = path.read_text().splitlines()
    record = json.loads(lines[3])
    record["input_ids"][1] = 400  # the tiny target's vocabulary has 400 tokens: ids 0..399
    lines[3] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:4.*400"):
        train(TrainOptions(dataset_dir=prep, out_dir=tmp_path / "run", online=True, **QUICK), show_progress=False)


def test_the_optimizer_is_fused_and_a_resume_keeps_it(data, tmp_path):
    """AdamW's fused kernel (one pass over every parameter); the checkpoint records it for the resume."""
    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=data / "v1", out_dir=run, stop_after=2, **QUICK), show_progress=False)
    state = formats.torch_load_safe(run / CHECKPOINTS_DIR / "step_00000002" / "training_state.pt")
    assert state["optimizer"]["param_groups"][0]["fused"] is True
    assert train(TrainOptions(dataset_dir=data / "v1", out_dir=run, resume=True), show_progress=False).step == 4


@pytest.mark.parametrize(
    "change, said",
    [
        ({"step": -7}, r"step -7, trajectory or best of the wrong kind"),
        (
            {"plan": {"total_steps": 10**9, "warmup": 1, "eval_every": 2, "save_every": 2, "calibrated": True}},
            r"plan of 1000000000 steps, the run's --total-steps is 4",
        ),
        (
            {"plan": {"total_steps": 4, "warmup": 1, "eval_every": 0, "save_every": 2, "calibrated": True}},
            r"total_steps, eval_every, save_every must be whole numbers >= 1",
        ),
        ({"best": {"step": 10**9, "tau": 1.0}}, r"best step 1000000000"),
        ({"trajectory": None}, r"trajectory or best of the wrong kind"),
    ],
)
def test_a_damaged_training_state_is_named_before_it_drives_the_loop(data, tmp_path, change, said):
    """A training_state.pt's plan of 10^9 steps trained on past --total-steps; step -7, eval_every 0
    or a missing trajectory ended in IndexError, ZeroDivisionError or KeyError."""
    import torch

    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=data / "v1", out_dir=run, **{**QUICK, "stop_after": 2}), show_progress=False)
    state_file = run / CHECKPOINTS_DIR / "step_00000002" / "training_state.pt"
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, **change}, state_file)
    with pytest.raises(ValueError, match=rf"training_state.pt: damaged \(.*{said}"):
        train(TrainOptions(dataset_dir=data / "v1", out_dir=run, resume=True, **QUICK), show_progress=False)


def test_a_pipe_where_a_side_file_should_be_is_named_not_read(tmp_path):
    """check once blocked forever reading a sample_lengths.json that was a FIFO."""
    import os

    fifo = tmp_path / "sample_lengths.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="sample_lengths.json: a pipe or device where eaglet expects a JSON file"):
        formats.read_json(fifo)
    with pytest.raises(ValueError, match="a pipe or device where eaglet expects a torch file"):
        formats.torch_load_safe(fifo)
    # the probe's three hangs: metrics.jsonl on resume, prepared.jsonl in extract (a signature log: test_signatures)
    metrics = tmp_path / "metrics.jsonl"
    os.mkfifo(metrics)
    with pytest.raises(ValueError, match="metrics.jsonl: a pipe or device where eaglet expects a JSON-lines log"):
        formats.read_jsonl_log(metrics)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    formats.write_json_atomic(prepared / formats.PREPARE_CONFIG_FILE, {"max_length": 8})
    os.mkfifo(prepared / formats.PREPARED_FILE)
    with pytest.raises(ValueError, match="prepared.jsonl: a pipe or device where eaglet expects the prepared samples"):
        formats.read_prepared(prepared)


def test_pruning_removes_only_the_checkpoints_a_run_writes(tmp_path):
    """A user's step_00000004.bak sorted among the steps and was deleted as one; an export put into
    a checkpoint folder, and one named like a checkpoint, were deleted with the step folders."""
    root = tmp_path / CHECKPOINTS_DIR
    for name in (
        "step_00000002",
        "step_00000004",
        "step_00000004.bak",
        "step_00000004-copy",
        "step_00000005",
        "step_00000006",
        "step_00000007",
        "step_notes",
        "step_00000008",
    ):
        (root / name).mkdir(parents=True)
        for file in (DRAFTER_CONFIG_FILE, MODEL_FILE, STATE_FILE):
            (root / name / file).write_text("x")
    (root / "step_00000005" / "exported").mkdir()  # a user's export inside a checkpoint
    (root / "step_00000007" / STATE_FILE).unlink()  # an export named like a checkpoint: no training state
    prune_checkpoints(root, keep=1, protect={"step_00000002"})
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000002",
        "step_00000004-copy",
        "step_00000004.bak",
        "step_00000005",
        "step_00000007",
        "step_00000008",
        "step_notes",
    ]


@pytest.mark.parametrize("line", ['{"foo": 1}', '{"step": "x"}', "[1, 2]", '{"step": true}', '{"step": -5}'])
def test_a_metrics_line_that_is_no_metric_is_named_on_resume(tmp_path, line):
    """train --resume ended in KeyError 'step' / TypeError on such a line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: record 2 \(.*\) is no metric line of a run"):
        truncate_metrics(path, 1)
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 3, "loss": 1.0}\n')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n'


def test_a_damaged_or_edited_checkpoint_is_never_resumed_from_nor_exported(data, tiny_target, tmp_path):
    """A d2t shifted in the latest checkpoint was resumed from and carried to the end of the run
    (export refused it only then); a checkpoint's top-level aux ids edited apart from its
    eaglet.draft_config were exported as if untouched; embeddings not the target's were exported."""
    from eaglet.export import export_drafter, import_drafter

    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=data / "v1", out_dir=run, stop_after=2, **QUICK), show_progress=False)
    ckpt = run / CHECKPOINTS_DIR / "step_00000002"
    weights = formats.read_safetensors(ckpt / formats.DRAFTER_WEIGHTS_FILE)
    config = formats.read_json(ckpt / formats.DRAFTER_CONFIG_FILE)
    damaged = dict(weights, d2t=weights["d2t"] + (torch.arange(weights["d2t"].numel()) % 7 == 5).long() * 7)
    save_file(damaged, str(ckpt / formats.DRAFTER_WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"model\.safetensors: field d2t disagrees with t2d at \d+ draft ids"):
        train(TrainOptions(dataset_dir=data / "v1", out_dir=run, resume=True), show_progress=False)
    other_embeddings = dict(weights, **{"embed_tokens.weight": torch.randn_like(weights["embed_tokens.weight"])})
    save_file(other_embeddings, str(ckpt / formats.DRAFTER_WEIGHTS_FILE))  # sound, but not the target's
    with pytest.raises(ValueError, match=r"model\.safetensors: field embed_tokens\.weight is not the target's"):
        train(TrainOptions(dataset_dir=data / "v1", out_dir=run, resume=True), show_progress=False)
    # export and import compare them with the target too (eval: tests/evaluate)
    other = r"field embed_tokens\.weight is not the embeddings of the target .*a drafter of another target"
    with pytest.raises(ValueError, match=other):
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "export", fmt="speculators"))
    with pytest.raises(ValueError, match=other):
        import_drafter(ImportOptions(src=ckpt, out=tmp_path / "imported", target=str(tiny_target)))
    assert not (tmp_path / "export").exists() and not (tmp_path / "imported").exists()
    save_file(weights, str(ckpt / formats.DRAFTER_WEIGHTS_FILE))
    edited = dict(config, eagle_aux_hidden_state_layer_ids=[3, 4, 5])
    formats.write_json_atomic(ckpt / formats.DRAFTER_CONFIG_FILE, edited)
    with pytest.raises(
        ValueError,
        match=r"config\.json: field eagle_aux_hidden_state_layer_ids \[3, 4, 5\] is not "
        r"what eaglet\.draft_config implies \(\[2, 4, 5\]\); the file was edited",
    ):
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "export", fmt="speculators"))
    formats.write_json_atomic(ckpt / formats.DRAFTER_CONFIG_FILE, config)
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "export", fmt="speculators"))


def test_no_drafter_folder_is_written_among_a_runs_checkpoints(data, tmp_path):
    """An export into a checkpoint folder, or named like a future checkpoint, was deleted by the
    run's pruning on --resume: refused before anything is written."""
    from eaglet.export import export_drafter, import_drafter

    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=data / "v1", out_dir=run, stop_after=2, **QUICK), show_progress=False)
    checkpoints = run / CHECKPOINTS_DIR
    for out in (checkpoints / "step_00000002" / "exported", checkpoints / "step_00000012"):
        with pytest.raises(
            FileExistsError,
            match=r"inside .*checkpoints, a train run's checkpoints, which the run "
            r"prunes",
        ):
            export_drafter(ExportOptions(ckpt=run, out=out, fmt="eagle"))
        with pytest.raises(FileExistsError, match=r"a train run's checkpoints"):
            import_drafter(ImportOptions(src=checkpoints / "step_00000002", out=out))
        assert not out.exists()
    export_drafter(ExportOptions(ckpt=run, out=run / "exported", fmt="eagle"))  # beside them: as before


def test_a_metrics_file_that_is_a_link_is_refused(tmp_path):
    """A metrics.jsonl linked to a file elsewhere (there or not yet) had the run's metrics appended there."""
    elsewhere = tmp_path / "elsewhere" / "planted.jsonl"
    elsewhere.parent.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(elsewhere)
    with pytest.raises(
        ValueError,
        match=r"metrics\.jsonl: a link \(to .*planted\.jsonl\); a run writes its metrics "
        r"inside its folder only",
    ):
        truncate_metrics(run / "metrics.jsonl", 0)
    assert not elsewhere.exists()


def test_a_resume_removes_half_written_checkpoints_and_nothing_inside_a_users_folder(tmp_path):
    """The sweep of temp files walked into a user's step_00000004.bak and deleted its .x.tmp-* files."""
    root = tmp_path / CHECKPOINTS_DIR
    (root / "step_00000004.bak" / f".notes{formats.TMP_MARK}1").mkdir(parents=True)
    (root / f".step_00000009{formats.TMP_MARK}abc").mkdir()
    assert formats.remove_stale_temp_files(root, recursive=False) == 1
    assert sorted(p.name for p in root.rglob("*")) == [f".notes{formats.TMP_MARK}1", "step_00000004.bak"]
