"""`eaglet train` on every hidden-state layout `eaglet check` accepts, and `--online` (the target
run inside the loop): each must train exactly like eaglet's own v1 copy of the same tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_jsonl
from eaglet import formats
from eaglet.check.dataset import single_threaded_ops
from eaglet.cli import main as cli_main
from eaglet.prepare import prepare
from eaglet.extract import extract
from eaglet.training.checkpoints import iter_metrics
from eaglet.dataset import open_dataset
from eaglet.formats.prepared import count_masked
from eaglet.training.loop import train
from helpers import FAST, chat_records, final_norm, write_foreign
from eaglet.options import ExtractOptions, PrepareOptions, TrainOptions

AUX = [2, 4, 5]  # the default aux ids of the tiny 8-layer target, which the fixture's extraction used
RUN = dict(FAST, total_steps=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Module-wide, so the module's fixtures (the extraction, the v1 run) run like its tests."""
    with single_threaded_ops():  # tiny matrices: a second thread only spins
        yield


@pytest.fixture(scope="module")
def work(tiny_target, tmp_path_factory) -> Path:
    """`prep/` (eaglet prepare) and `data/` (its fp32 v1 extraction, so online can match it closely)."""
    work = tmp_path_factory.mktemp("sources")
    prepare(
        PrepareOptions(
            target=str(tiny_target),
            data=str(write_jsonl(work / "chats.jsonl", chat_records())),
            out=work / "prep",
            max_length=512,
        )
    )
    extract(
        ExtractOptions(
            prepared=work / "prep", out=work / "data", target=str(tiny_target), dtype="fp32", store_dtype="fp32"
        ),
        show_progress=False,
    )
    return work


@pytest.fixture(scope="module")
def v1_run(work, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("v1_run") / "run"
    train(TrainOptions(dataset_dir=work / "data", out_dir=run, **RUN))
    return run


def records(run: Path) -> list[dict]:
    """Metrics without the timings."""
    return [{k: v for k, v in r.items() if k not in ("elapsed", "train_seconds")} for r in iter_metrics(run)]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


@pytest.mark.parametrize(
    "layout",
    [formats.FORMAT_V1_FLAT, formats.FORMAT_SPECFORGE, formats.FORMAT_HS_SAFETENSORS, formats.FORMAT_SPECULATORS_ARROW],
)
def test_foreign_layout_trains_exactly_like_v1(layout, work, v1_run, tiny_target, tmp_path):
    foreign = write_foreign(work / "data", tmp_path / "foreign", layout, final_norm(tiny_target))
    assert formats.list_dataset_files(foreign).format == layout
    ds = open_dataset(foreign, aux_layer_ids=AUX)  # lengths and token frequencies computed from the files
    v1 = open_dataset(work / "data")
    assert (ds.lengths, ds.token_freq) == (v1.lengths, v1.token_freq)
    assert ds.last_hidden_state == ("post_norm" if layout == formats.FORMAT_SPECFORGE else "pre_norm")
    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=foreign, out_dir=run, target=str(tiny_target), aux_layer_ids=AUX, **RUN))
    assert records(run) == records(v1_run)
    a, b = weights(v1_run, 4), weights(run, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = formats.read_json(run / "checkpoints" / "step_00000004" / "config.json")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX


def test_foreign_side_files_are_used_when_present(work, v1_run, tmp_path):
    """A flat v1 folder with eaglet's side files: layer ids and target come from data_config.json."""
    foreign = write_foreign(work / "data", tmp_path / "flat", formats.FORMAT_V1_FLAT, torch.nn.Identity())
    for name in (formats.DATA_CONFIG_FILE, formats.SAMPLE_LENGTHS_FILE, formats.TOKEN_FREQ_FILE):
        shutil.copy(work / "data" / name, foreign / name)
    train(TrainOptions(dataset_dir=foreign, out_dir=tmp_path / "run", **RUN))
    assert records(tmp_path / "run") == records(v1_run)
    with pytest.raises(ValueError, match="records aux ids"):
        open_dataset(foreign, aux_layer_ids=[1, 4, 5])


def test_foreign_dataset_refusals(work, tiny_target, tmp_path):
    hs = write_foreign(work / "data", tmp_path / "hs", formats.FORMAT_HS_SAFETENSORS, torch.nn.Identity())
    with pytest.raises(ValueError, match="--aux-layer-ids"):
        open_dataset(hs)
    with pytest.raises(ValueError, match="pass --target"):
        train(TrainOptions(dataset_dir=hs, out_dir=tmp_path / "r", aux_layer_ids=AUX, **RUN))
    with pytest.raises(ValueError, match="aux layer ids"):
        train(
            TrainOptions(
                dataset_dir=hs, out_dir=tmp_path / "r", target=str(tiny_target), aux_layer_ids=[2, 4, 8], **RUN
            )
        )
    s = formats.read_hs_safetensors_sample(hs / "hs_0.safetensors")
    formats.write_hs_safetensors_sample(hs, 0, s["token_ids"], s["hidden_states"])  # no loss_mask
    with pytest.raises(ValueError, match="hs_0.safetensors: no loss_mask"):
        open_dataset(hs, aux_layer_ids=AUX)
    with pytest.raises(FileNotFoundError, match="--online"):
        open_dataset(work / "prep")
    with pytest.raises(FileNotFoundError, match="without --online"):
        train(TrainOptions(dataset_dir=work / "data", out_dir=tmp_path / "r", online=True), show_progress=False)


@pytest.mark.parametrize("max_length", [None, 40])  # online truncates before the target runs, offline after
def test_online_matches_offline(work, tmp_path, max_length):
    """The target run in the loop gives the hidden states extraction stored: same losses and metrics."""
    opts = dict(RUN, total_steps=2, eval_every=1, log_every=1, max_length=max_length)
    train(TrainOptions(dataset_dir=work / "data", out_dir=tmp_path / "off", **opts))
    train(TrainOptions(dataset_dir=work / "prep", out_dir=tmp_path / "on", online=True, target_dtype="fp32", **opts))
    off, on = records(tmp_path / "off"), records(tmp_path / "on")
    assert (
        [(r["step"], r["split"]) for r in off]
        == [(r["step"], r["split"]) for r in on]
        == [(1, "train"), (1, "eval"), (2, "train"), (2, "eval")]
    )
    for a, b in zip(off, on):
        assert a["positions"] == b["positions"] and a["acc"] == b["acc"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        assert b["tau"] == pytest.approx(a["tau"], rel=1e-6)
    cfg = formats.read_json(tmp_path / "on" / "checkpoints" / "step_00000002" / "config.json")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX and cfg["eaglet"]["online"] is True


def test_online_resume_continues_exactly(work, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    opts = dict(RUN, online=True, target_dtype="fp32", eval_every=2, save_every=2)  # stop_after=2 evaluates at 2
    train(TrainOptions(dataset_dir=work / "prep", out_dir=straight, **opts))
    assert train(TrainOptions(dataset_dir=work / "prep", out_dir=resumed, stop_after=2, **opts)).step == 2
    train(TrainOptions(dataset_dir=work / "prep", out_dir=resumed, resume=True, **opts))
    a, b = weights(straight, 4), weights(resumed, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in iter_metrics(resumed)] == [r["step"] for r in iter_metrics(straight)]
    with pytest.raises(ValueError, match="aux_layer_ids"):  # other captured layers: another trajectory
        train(TrainOptions(dataset_dir=work / "prep", out_dir=resumed, resume=True, aux_layer_ids=[1, 3, 5], **opts))


def test_cli_train_online(work, tmp_path, capsys):
    rc = cli_main(
        [
            "train",
            str(work / "prep"),
            "--online",
            "--target-dtype",
            "fp32",
            "--out",
            str(tmp_path / "run"),
            "--total-steps",
            "1",
            "--ttt-steps",
            "2",
            "--eval-every",
            "1",
            "--aux-layer-ids",
            "1,3,6",
        ]
    )
    assert rc == 0 and "best checkpoint: step 1" in capsys.readouterr().out
    cfg = formats.read_json(tmp_path / "run" / "checkpoints" / "step_00000001" / "config.json")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]


def test_a_wrong_last_state_convention_is_refused_with_its_file_and_the_fix(work, tiny_target, monkeypatch):
    """The tiny random target predicts nothing either way, so the convention check's verdict is
    stood in for; the message built from it once raised AttributeError (Problem has no `file`)."""
    from eaglet.check.report import Problem
    from eaglet.heads import read_heads
    from eaglet.training import data

    wrong = Problem("last state", "hidden_states/rows_0-2000/data_0.pt", "reads better after the final norm")
    monkeypatch.setattr(data, "convention_problem", lambda *args: wrong)
    with pytest.raises(
        ValueError,
        match=r"data_0.pt: reads better after the final norm \(.*data_config.json, or "
        r"--last-hidden-state .*`eaglet check` for the full report",
    ):
        data.refuse_wrong_last_state(open_dataset(work / "data"), read_heads(tiny_target))


def test_online_refuses_a_prepared_folder_its_side_files_contradict(work, tmp_path):
    """A token_freq.pt of {7: 10^9} built the draft vocabulary without the data's own tokens, and
    --online trained on it (offline, check refuses such a dataset)."""
    prep = Path(shutil.copytree(work / "prep", tmp_path / "prep"))
    formats.write_token_freq(prep / formats.TOKEN_FREQ_FILE, {7: 10**9})
    with pytest.raises(ValueError, match=r"token_freq.pt counts token \d+ .* times, the samples' masks \d+"):
        train(TrainOptions(dataset_dir=prep, out_dir=tmp_path / "run", online=True, total_steps=1), show_progress=False)


def test_online_refuses_a_loss_mask_the_chat_template_does_not_imply(work, tmp_path):
    """A mask shifted one token later (its side files rewritten to agree) trained --online, where
    offline `eaglet check` refuses it: the prepared samples are compared with the template too."""
    prep = Path(shutil.copytree(work / "prep", tmp_path / "prep"))
    lines = [json.loads(line) for line in (prep / formats.PREPARED_FILE).read_text().splitlines()]
    lines[1]["loss_mask"] = [0] + lines[1]["loss_mask"][:-1]
    (prep / formats.PREPARED_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    samples, _ = formats.read_prepared(prep)
    freq: dict[int, int] = {}
    for s in samples:
        count_masked(freq, s)
    formats.write_token_freq(prep / formats.TOKEN_FREQ_FILE, freq)
    with pytest.raises(
        ValueError,
        match=rf"prepared.jsonl sample '{lines[1]['id']}': loss_mask: masked run at "
        r"tokens \d+\.\.\d+ does not start after the generation prompt; prepare the "
        "data again",
    ):
        train(TrainOptions(dataset_dir=prep, out_dir=tmp_path / "run", online=True, total_steps=1), show_progress=False)
