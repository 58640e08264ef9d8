"""speculators' dataset layout (Arrow table + hidden_states/hs_{i}.safetensors): written by
`eaglet extract --layout speculators` and `eaglet convert`, read by check (and by train: see
test_train_sources.py), and read by speculators' own data reader to the same tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "datasets",
    reason="speculators' layout is an Arrow table written with `datasets` (pip install 'eaglet[speculators]')",
)

from eaglet import check as C  # noqa: E402
from eaglet import formats  # noqa: E402
from eaglet.cli import main  # noqa: E402
from eaglet.convert import convert  # noqa: E402
from eaglet.formats.runs import resolve_checkpoint  # noqa: E402
from references import write_specforge_sample  # tests/references.py
from eaglet.options import CheckOptions, ConvertOptions, ExtractOptions, PrepareOptions

LAYER_IDS = [2, 3, 4, 8]  # the tiny target has 8 layers


@pytest.fixture(scope="module")
def extracted(tiny_target, tmp_path_factory) -> Path:
    """The same prepared chats extracted twice: root/v1 (default layout) and root/spec (--layout speculators)."""
    from conftest import CHATS, write_jsonl

    from eaglet.prepare import prepare
    from eaglet.extract import extract

    root = tmp_path_factory.mktemp("layouts")
    records = [{"id": f"c{n}", "messages": CHATS[n % len(CHATS)]} for n in range(7)]
    prepare(
        PrepareOptions(
            target=str(tiny_target),
            data=str(write_jsonl(root / "chats.jsonl", records)),
            out=root / "prep",
            max_length=256,
        )
    )
    for name, layout in (("v1", "v1"), ("spec", "speculators")):
        extract(
            ExtractOptions(
                prepared=root / "prep",
                out=root / name,
                target=str(tiny_target),
                layer_ids=LAYER_IDS,
                dtype="fp32",
                layout=layout,
            ),
            show_progress=False,
        )
    return root


def samples(folder: Path) -> dict[int, formats.TrainingSample]:
    listing = formats.list_dataset_files(folder)
    return {i: formats.read_training_sample(p, listing.format) for i, p in listing.files}


def assert_same_samples(a: Path, b: Path) -> None:
    sa, sb = samples(a), samples(b)
    assert sorted(sa) == sorted(sb) == list(range(len(sa)))
    for i in sa:
        for name in ("input_ids", "aux_hidden", "last_hidden", "loss_mask"):
            x, y = getattr(sa[i], name), getattr(sb[i], name)
            assert x.dtype == y.dtype and torch.equal(x, y), f"sample {i}: {name} differs between {a} and {b}"


def test_extract_writes_speculators_layout(extracted, tiny_target, tmp_path):
    spec = extracted / "spec"
    listing = formats.list_dataset_files(spec)
    assert listing.format == formats.FORMAT_SPECULATORS_ARROW and len(listing.files) == 7 and not listing.stray
    # Exactly speculators' files: the table, and hs files with token_ids + hidden_states [T, 4, H] only.
    hs = formats.read_safetensors(formats.speculators_hs_path(spec, 3))
    assert set(hs) == {"token_ids", "hidden_states"} and hs["hidden_states"].shape[1:] == (4, 64)
    assert hs["token_ids"].dtype == torch.int64 and hs["hidden_states"].dtype == torch.bfloat16
    table = formats.read_speculators_rows(spec)
    assert table.column_names == ["input_ids", "loss_mask", "seq_len"] and len(table) == 7
    assert json.loads((spec / "state.json").read_text())["_format_type"] == "torch"
    assert json.loads((spec / formats.DATA_CONFIG_FILE).read_text())["format"] == formats.FORMAT_SPECULATORS_ARROW
    assert formats.read_token_freq(spec / formats.TOKEN_FREQ_FILE)  # what `speculators train` builds d2t from
    # The same tensors as the v1 extraction, bit for bit, and clean with the target's layer identity.
    assert_same_samples(extracted / "v1", spec)
    report = C.check_dataset(CheckOptions(path=spec, target=str(tiny_target)))
    assert report.clean and report.format == formats.FORMAT_SPECULATORS_ARROW, report.lines()
    assert [s.best for s in report.identity] == [s.expected for s in report.identity]
    # A rerun finds every file complete; one damaged file is redone. On a copy: the module's
    # folder stays as extracted, for the tests that compare it bit for bit with v1.
    from eaglet.extract import extract

    spec = Path(shutil.copytree(spec, tmp_path / "spec"))
    before = {i: p.read_bytes() for i, p in formats.list_dataset_files(spec).files}
    victim = formats.speculators_hs_path(spec, 2)
    victim.write_bytes(victim.read_bytes()[:100])
    summary = extract(
        ExtractOptions(
            prepared=extracted / "prep",
            out=spec,
            target=str(tiny_target),
            layer_ids=LAYER_IDS,
            dtype="fp32",
            layout="speculators",
        ),
        show_progress=False,
    )
    assert summary.written == 1 and summary.already_done == 6
    after = {i: p.read_bytes() for i, p in formats.list_dataset_files(spec).files}
    assert all(after[i] == before[i] for i in after if i != 2)  # the complete files are kept as they were
    # The redone sample ran alone, in a batch of another shape than the first time: on CPUs whose
    # fp32 matrix kernels depend on the shape (AMX / AVX-512 ones do) its bits may differ; its
    # values are the same states, to within one bf16 rounding of the stored values.
    redone, ref = samples(spec)[2], samples(extracted / "v1")[2]
    assert torch.equal(redone.input_ids, ref.input_ids) and torch.equal(redone.loss_mask, ref.loss_mask)
    for name in ("aux_hidden", "last_hidden"):
        torch.testing.assert_close(getattr(redone, name).float(), getattr(ref, name).float(), rtol=2**-7, atol=1e-6)


def test_one_folder_one_layout(extracted, tiny_target):
    from eaglet.extract import extract

    with pytest.raises(ValueError, match="format='speculators-v1'.*'speculators-arrow'"):
        extract(
            ExtractOptions(
                prepared=extracted / "prep",
                out=extracted / "v1",
                target=str(tiny_target),
                layer_ids=LAYER_IDS,
                dtype="fp32",
                layout="speculators",
            ),
            show_progress=False,
        )


def test_convert_round_trip_is_bit_exact(extracted, tmp_path, capsys):
    """v1 -> speculators -> v1 gives back every tensor; each output is clean and resumable."""
    assert main(["convert", str(extracted / "v1"), "--out", str(tmp_path / "spec"), "--layout", "speculators"]) == 0
    assert "converted 7 samples" in capsys.readouterr().out
    convert(ConvertOptions(src=tmp_path / "spec", out=tmp_path / "back", layout="v1"), show_progress=False)
    for folder in (tmp_path / "spec", tmp_path / "back"):
        report = C.check_dataset(CheckOptions(path=folder, use_target=False))
        assert report.clean, report.lines()
    assert_same_samples(extracted / "v1", tmp_path / "spec")
    assert_same_samples(extracted / "v1", tmp_path / "back")
    back = json.loads((tmp_path / "back" / formats.DATA_CONFIG_FILE).read_text())
    v1 = json.loads((extracted / "v1" / formats.DATA_CONFIG_FILE).read_text())
    assert back["format"] == formats.FORMAT_V1 and back["converted_from"]["format"] == formats.FORMAT_SPECULATORS_ARROW
    for key in ("target_revision", "layer_ids", "last_hidden_state", "num_tokens", "num_masked_tokens", "seq_length"):
        assert back[key] == v1[key], key
    # v1 files each hold their own storages (no state dragging the others along).
    for name in ("v1", "back"):
        sizes = sorted(
            p.stat().st_size
            for p in formats.list_v1_files(tmp_path / name if name == "back" else extracted / name).values()
        )
        assert sizes == sorted(p.stat().st_size for p in formats.list_v1_files(extracted / "v1").values())
    # A kill mid-way leaves some files missing: the rerun writes only those.
    formats.speculators_hs_path(tmp_path / "spec", 4).unlink()
    summary = convert(
        ConvertOptions(src=extracted / "v1", out=tmp_path / "spec", layout="speculators"), show_progress=False
    )
    assert summary.written == 1 and summary.already_done == 6
    assert_same_samples(extracted / "v1", tmp_path / "spec")


def test_convert_refusals(extracted, tmp_path, tiny_target):
    with pytest.raises(FileExistsError, match="is the source"):
        convert(ConvertOptions(src=extracted / "v1", out=extracted / "v1", layout="speculators"), show_progress=False)
    with pytest.raises(ValueError, match="eaglet writes"):
        convert(ConvertOptions(src=extracted / "v1", out=tmp_path / "x", layout="v2"), show_progress=False)
    # A SpecForge dataset: post-norm last state, no data_config.json.
    sf = tmp_path / "sf"
    for i, s in samples(extracted / "v1").items():
        write_specforge_sample(sf, i, s.input_ids, s.loss_mask, s.last_hidden, s.aux_hidden)
    with pytest.raises(ValueError, match="speculators applies that norm itself"):
        convert(
            ConvertOptions(src=sf, out=tmp_path / "x", layout="speculators", aux_layer_ids=LAYER_IDS[:3]),
            show_progress=False,
        )
    with pytest.raises(ValueError, match="pass --target"):
        convert(
            ConvertOptions(src=sf, out=tmp_path / "x", layout="v1", aux_layer_ids=LAYER_IDS[:3]), show_progress=False
        )
    convert(
        ConvertOptions(
            src=sf, out=tmp_path / "sf_v1", layout="v1", target=str(tiny_target), aux_layer_ids=LAYER_IDS[:3]
        ),
        show_progress=False,
    )
    cfg = json.loads((tmp_path / "sf_v1" / formats.DATA_CONFIG_FILE).read_text())
    assert cfg["last_hidden_state"] == "post_norm" and cfg["layer_ids"] == LAYER_IDS
    report = C.check_dataset(CheckOptions(path=tmp_path / "sf_v1", use_target=False))
    assert report.clean, report.lines()
    # A gap in the indices cannot be paired row by row.
    gap = Path(shutil.copytree(extracted / "v1", tmp_path / "gap"))
    (gap / formats.v1_relative_path(3)).unlink()
    cfg = json.loads((gap / formats.DATA_CONFIG_FILE).read_text())
    cfg.pop("num_samples")
    formats.write_json_atomic(gap / formats.DATA_CONFIG_FILE, cfg)
    with pytest.raises(ValueError, match=r"no file for \[3\]"):
        convert(ConvertOptions(src=gap, out=tmp_path / "x", layout="speculators"), show_progress=False)


@pytest.fixture
def spec_copy(extracted, tmp_path) -> Path:
    return Path(shutil.copytree(extracted / "spec", tmp_path / "spec"))


def rewrite_hs(folder: Path, i: int, **changes: torch.Tensor) -> None:
    obj = formats.read_safetensors(formats.speculators_hs_path(folder, i))
    obj.update(changes)
    formats.write_hs_safetensors_sample(folder / formats.HIDDEN_STATES_DIR, i, obj["token_ids"], obj["hidden_states"])


def test_check_names_faults_of_the_speculators_layout(spec_copy):
    ds = spec_copy
    ids = formats.read_safetensors(formats.speculators_hs_path(ds, 1))["token_ids"].clone()
    ids[5] = (ids[5] + 1) % 300
    rewrite_hs(ds, 1, token_ids=ids)  # a file of another sample
    hs = formats.read_safetensors(formats.speculators_hs_path(ds, 2))["hidden_states"]
    rewrite_hs(ds, 2, hidden_states=hs[:, :3].contiguous())  # a state missing
    formats.speculators_hs_path(ds, 4).unlink()  # a row without its file
    shutil.copy(formats.speculators_hs_path(ds, 0), formats.speculators_hs_path(ds, 9))  # a file without a row
    trunc = formats.speculators_hs_path(ds, 5)
    trunc.write_bytes(trunc.read_bytes()[:64])
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert not report.clean
    kinds = {(p.kind, p.path) for p in report.problems}
    assert (C.TABLE_ROW, "hidden_states/hs_1.safetensors") in kinds
    assert (C.TABLE_ROW, "hidden_states/hs_9.safetensors") in kinds
    assert (C.STATE_COUNT, "hidden_states/hs_2.safetensors") in kinds
    assert (C.UNREADABLE, "hidden_states/hs_5.safetensors") in kinds
    msg = " ".join(p.message for p in report.problems)
    assert "first difference at position 5" in msg and "speculators skips this sample" in msg
    assert any(p.kind == C.MISSING_INDEX and p.message.endswith("have no file: 4") for p in report.problems)
    # train refuses the same dataset with the file named.
    from eaglet.dataset import open_dataset

    with pytest.raises(ValueError, match=r"table has 7 rows; no file for row\(s\) \[4\], file\(s\) \[9\] beyond"):
        open_dataset(ds)
    with pytest.raises(ValueError, match="hs_1.safetensors: token_ids differ from row 1"):
        formats.read_training_sample(formats.speculators_hs_path(ds, 1), formats.FORMAT_SPECULATORS_ARROW)


def test_a_file_loss_mask_the_table_contradicts_is_named(spec_copy):
    """speculators' files carry no loss_mask; one that does and disagrees with its table row was
    accepted (which of the two is right cannot be known)."""
    obj = formats.read_safetensors(formats.speculators_hs_path(spec_copy, 2))
    mask = torch.tensor(formats.read_speculators_rows(spec_copy)[2]["loss_mask"], dtype=torch.long)
    agrees, shifted = mask.clone(), torch.roll(mask, 1)
    formats.write_hs_safetensors_sample(
        spec_copy / formats.HIDDEN_STATES_DIR, 2, obj["token_ids"], obj["hidden_states"], agrees
    )
    assert C.check_dataset(CheckOptions(path=spec_copy, use_target=False)).clean
    formats.write_hs_safetensors_sample(
        spec_copy / formats.HIDDEN_STATES_DIR, 2, obj["token_ids"], obj["hidden_states"], shifted
    )
    report = C.check_dataset(CheckOptions(path=spec_copy, use_target=False))
    assert [(p.kind, p.path) for p in report.errors] == [(C.TABLE_ROW, "hidden_states/hs_2.safetensors")]
    assert "loss_mask differs from row 2's loss_mask (first difference at position" in report.errors[0].message


def test_check_names_a_damaged_table(spec_copy):
    (spec_copy / "state.json").write_text("{not json")
    report = C.check_dataset(CheckOptions(path=spec_copy, use_target=False))
    assert [p.kind for p in report.problems] == [C.UNREADABLE] and "state.json" == report.problems[0].path
    assert "Arrow table" in report.problems[0].message


def test_the_table_is_read_from_its_own_folder_only(spec_copy, tmp_path):
    """state.json names the table's files, and `datasets` once opened them anywhere: a table moved
    out of the folder and named by path was checked CLEAN and trained on."""
    state = json.loads((spec_copy / "state.json").read_text())
    arrow = spec_copy / state["_data_files"][0]["filename"]
    outside = tmp_path / "outside"
    outside.mkdir()
    arrow.rename(outside / arrow.name)
    for name in (str(outside / arrow.name), f"../outside/{arrow.name}"):
        state["_data_files"][0]["filename"] = name
        (spec_copy / "state.json").write_text(json.dumps(state))
        report = C.check_dataset(CheckOptions(path=spec_copy, use_target=False))
        assert not report.clean and any("_data_files" in p.message for p in report.problems), report.problems


def test_speculators_own_reader_yields_the_same_tensors(extracted):
    data = pytest.importorskip(
        "speculators.train.data",
        reason="the peer library is installed by ./scripts/bootstrap --test (requirements-peers.lock)",
    )
    spec = extracted / "spec"
    reader = data.ArrowDataset(max_len=4096, datapath=str(spec), on_missing="raise")
    assert len(reader) == 7 and reader.approx_lengths == [len(s.input_ids) for s in samples(spec).values()]
    for i, s in samples(extracted / "v1").items():
        got = reader[i]
        assert torch.equal(got["input_ids"], s.input_ids), i
        assert torch.equal(got["loss_mask"].long(), s.loss_mask), i
        assert torch.equal(got["hidden_states"], s.aux_hidden), i  # [T, 3H], aux states in id order
        assert torch.equal(got["verifier_last_hidden_states"], s.last_hidden), i  # pre-norm, speculators norms it


def test_data_config_is_typed_read_and_written_in_one_place(tmp_path):
    """data_config.json goes through formats.DataConfig: a field of the wrong kind is an error naming
    the file and the field, keys eaglet does not know survive a read and a write, and a missing
    file is None (a foreign dataset without one)."""
    assert formats.read_data_config(tmp_path) is None
    formats.write_json_atomic(
        tmp_path / formats.DATA_CONFIG_FILE,
        {"format": "v1", "hidden_size": 64, "layer_ids": [2, 3, 4, 6], "their_key": {"a": 1}},
    )
    cfg = formats.read_data_config(tmp_path)
    assert (cfg.format, cfg.hidden_size, cfg.layer_ids, cfg.vocab_size) == ("v1", 64, [2, 3, 4, 6], None)
    assert cfg.extra == {"their_key": {"a": 1}} and cfg.rows == formats.ROWS_PER_FOLDER
    formats.write_data_config(tmp_path, cfg)
    assert formats.read_json(tmp_path / formats.DATA_CONFIG_FILE)["their_key"] == {"a": 1}
    formats.write_json_atomic(tmp_path / formats.DATA_CONFIG_FILE, {"hidden_size": "64", "layer_ids": [2, "x"]})
    with pytest.raises(
        ValueError,
        match=r"data_config.json: hidden_size '64': expected a positive int; "
        r"layer_ids \[2, 'x'\]: expected a list of ints >= 0",
    ):
        formats.read_data_config(tmp_path)
    with pytest.raises(ValueError, match="expected a positive int"):
        formats.read_data_config(tmp_path)  # the same again: nothing was cached or half-read
    # sizes of 0 or below once passed for ints (rows_per_folder 0 divides by zero in every reader)
    formats.write_json_atomic(
        tmp_path / formats.DATA_CONFIG_FILE,
        {"rows_per_folder": 0, "max_length": -1, "num_samples": 0, "layer_ids": [-1, 2]},
    )
    with pytest.raises(
        ValueError,
        match=r"rows_per_folder 0: expected a positive int; max_length -1: expected a "
        r"positive int; layer_ids \[-1, 2\]: expected a list of ints >= 0",
    ):
        formats.read_data_config(tmp_path)
    assert formats.parse_data_config([1, 2])[1] == ["a JSON list, not an object"]


def test_a_hand_edited_prepared_line_is_refused_by_line():
    """A loss mask of 2 or a sample of no tokens reached extraction, and check refused the dataset."""
    good = {"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]}
    assert formats.TokenizedSample.from_json(json.dumps(good), "p.jsonl:1").loss_mask == [0, 1]
    with pytest.raises(ValueError, match=r"p.jsonl:3: sample a: field loss_mask holds 2; a loss mask is 0 or 1"):
        formats.TokenizedSample.from_json(json.dumps({**good, "loss_mask": [0, 2]}), "p.jsonl:3")
    with pytest.raises(ValueError, match="p.jsonl:4: sample a has no tokens"):
        formats.TokenizedSample.from_json(json.dumps({**good, "input_ids": [], "loss_mask": []}), "p.jsonl:4")


@pytest.mark.parametrize(
    "pointer, message",
    [
        ({"step": 1, "path": "../../elsewhere"}, "leads out of"),
        ({"step": 1, "path": "/tmp"}, "is not a path relative to"),
        ({"step": 1}, r"expected \{\"step\": N, \"path\": \"step_...\"\}"),
        ({"step": 1, "path": 5}, "expected"),
        ([1], "expected"),
    ],
)
def test_a_checkpoint_pointer_leads_only_inside_its_run(tmp_path, pointer, message):
    """best.json's path once led export to any folder, and a damaged one gave KeyError / TypeError."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.json").write_text(json.dumps(pointer))
    with pytest.raises(ValueError, match=rf"checkpoints/best.json: .*{message}"):
        resolve_checkpoint(tmp_path)
