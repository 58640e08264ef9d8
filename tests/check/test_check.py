"""`eaglet check`: a clean extracted dataset passes; each corruption is found and named."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from eaglet import check as C
from eaglet.check import dataset as check_dataset_module
from eaglet.check import files as check_files
from eaglet import formats
from eaglet.cli import main
from references import write_flat_v1_sample, write_specforge_sample  # tests/references.py
from eaglet.options import CheckOptions, ExtractOptions, PrepareOptions


def tiny_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def N(tiny_target) -> int:
    return tiny_config(tiny_target)["num_hidden_layers"]


@pytest.fixture(scope="module")
def LAYER_IDS(N) -> list[int]:
    return [2, 3, 4, N]  # aux ids then the last layer


@pytest.fixture(scope="module")
def clean(tiny_target, tmp_path_factory, LAYER_IDS) -> Path:
    """A dataset made by `eaglet extract` on the tiny target (fp32 compute, bf16 storage)."""
    from conftest import CHATS, write_jsonl

    from eaglet.prepare import prepare
    from eaglet.extract import extract

    root = tmp_path_factory.mktemp("check")
    records = []
    for n in range(12):
        chat = [dict(m) for m in CHATS[n % len(CHATS)]]
        chat[-1]["content"] = chat[-1]["content"] + " " + " ".join(["More words."] * (n % 5))
        records.append({"id": f"chat{n}", "messages": chat})
    chats = write_jsonl(root / "chats.jsonl", records)
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats), out=root / "prep", max_length=256))
    extract(
        ExtractOptions(
            prepared=root / "prep", out=root / "data", target=str(tiny_target), layer_ids=LAYER_IDS, dtype="fp32"
        ),
        show_progress=False,
    )
    return root / "data"


@pytest.fixture
def copy(clean, tmp_path):
    def make(name: str = "ds") -> Path:
        return Path(shutil.copytree(clean, tmp_path / name))

    return make


def sample_path(ds: Path, i: int) -> Path:
    return ds / formats.v1_relative_path(i)


def edit(ds: Path, i: int, fn) -> str:
    """Load sample i, let `fn` change the dict, save it back; return its relative path."""
    path = sample_path(ds, i)
    obj = torch.load(path, weights_only=True)
    fn(obj)
    torch.save(obj, path)
    return formats.v1_relative_path(i)


def found(report: C.CheckReport, kind: str) -> list[C.Problem]:
    return [p for p in report.errors if p.kind == kind]


def assert_found(report: C.CheckReport, kind: str, path: str | None = None, *words: str) -> C.Problem:
    hits = [p for p in found(report, kind) if path is None or p.path == path]
    assert hits, f"no {kind!r} problem for {path}; got {[(p.kind, p.path, p.message) for p in report.problems]}"
    for w in words:
        assert any(w in p.message for p in hits), f"{w!r} not in {[p.message for p in hits]}"
    assert not report.clean
    return hits[0]


def run_cli(*argv: str) -> int:
    try:
        return main(["check", *argv])
    except SystemExit as e:
        return int(e.code)


# ---------------------------------------------------------------------------------------------
# The clean dataset
# ---------------------------------------------------------------------------------------------


def test_clean_dataset_passes_with_target(clean, capsys, LAYER_IDS):
    report = C.check_dataset(CheckOptions(path=clean))  # target from data_config's target_path
    assert report.clean, report.lines()
    assert report.format == formats.FORMAT_V1
    assert report.files == report.samples == 12 and report.tokens > 0 and 0 < report.masked_tokens < report.tokens
    assert [s.expected for s in report.identity] == [f"layer {k}" for k in LAYER_IDS]
    assert all(s.best == s.expected and s.cos > 0.999 for s in report.identity)
    assert report.next_token_accuracy["agreement"] > 0.9
    assert report.template_checked_files == 12
    assert [s.layer for s in report.slots] == [f"layer {k}" for k in LAYER_IDS]
    assert run_cli(str(clean)) == 0
    out = capsys.readouterr().out
    assert "result: CLEAN" in out and "bytes/token" in out and "lengths:" in out


def test_json_output_parses(clean, capsys):
    assert run_cli(str(clean), "--json", "--no-target") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] is True and data["format"] == formats.FORMAT_V1 and data["files"] == 12
    assert data["warning_counts"] == {C.NOT_CHECKED: 1}  # skipped checks are said, not silently passed


def test_target_asked_for_but_unloadable_is_not_a_pass(clean, tmp_path, capsys):
    broken = tmp_path / "broken-target"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert run_cli(str(clean), "--target", str(broken)) != 0
    out = capsys.readouterr().out
    assert "could not run" in out and "result: CLEAN" not in out


def test_damaged_json_side_file_is_named(tmp_path):
    cut = tmp_path / "data_config.json"
    cut.write_text('{"layer_ids": [1, 2, 3, 4], "target": "x')
    with pytest.raises(ValueError, match=r"data_config.json: not valid JSON \(Unterminated string"):
        formats.read_json(cut)


def test_corrupt_dataset_exits_nonzero(copy, capsys):
    ds = copy()
    rel = edit(ds, 4, lambda o: o["loss_mask"].zero_())
    assert run_cli(str(ds), "--no-target") == 1
    out = capsys.readouterr().out
    assert "NOT CLEAN" in out and rel in out


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


class Boom:
    """Loading this without weights_only would create a file: proof that nothing is executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_unsafe_pickle_is_reported_not_executed(copy, tmp_path):
    ds = copy()
    marker = tmp_path / "executed"
    torch.save({"input_ids": torch.zeros(3, dtype=torch.long), "boom": Boom(str(marker))}, sample_path(ds, 2))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    p = assert_found(report, C.UNSAFE_PICKLE, formats.v1_relative_path(2), "weights_only")
    assert "open" in p.message  # names the global it refused
    assert not marker.exists()


def test_truncated_file(copy):
    ds = copy()
    path = sample_path(ds, 7)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)), C.UNREADABLE, formats.v1_relative_path(7), "truncated"
    )


def test_garbage_file(copy):
    ds = copy()
    sample_path(ds, 1).write_bytes(b"not a torch file" * 10)
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.UNREADABLE, formats.v1_relative_path(1))


# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------


def test_mask_5147_vs_input_ids_4095(copy, LAYER_IDS, tiny_target):
    """The one seen in the wild: a loss_mask longer than input_ids."""
    ds = copy()
    T, H = 4095, tiny_config(tiny_target)["hidden_size"]
    sample = {
        "input_ids": torch.randint(0, 300, (T,)),
        "loss_mask": torch.ones(5147, dtype=torch.long),
        "hidden_states": [torch.randn(T, H).mul(0.02).to(torch.bfloat16) for _ in LAYER_IDS],
    }
    torch.save(sample, sample_path(ds, 3))
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)),
        C.LENGTH_MISMATCH,
        formats.v1_relative_path(3),
        "loss_mask has 5147 entries, input_ids has 4095",
    )


def test_wrong_keys(copy):
    ds = copy()
    rel = edit(ds, 0, lambda o: o.update(extra=torch.zeros(1)))
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.WRONG_KEYS, rel, "unexpected ['extra']")
    rel = edit(ds, 1, lambda o: o.pop("loss_mask"))
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.WRONG_KEYS, rel, "missing ['loss_mask']")


def test_wrong_dtypes(copy):
    ds = copy()
    rel_h = edit(ds, 0, lambda o: o.update(hidden_states=[h.half() for h in o["hidden_states"]]))
    rel_i = edit(ds, 1, lambda o: o.update(input_ids=o["input_ids"].float()))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.WRONG_DTYPE, rel_h, "float16, recorded bfloat16")
    assert_found(report, C.WRONG_DTYPE, rel_i, "input_ids")


def test_hidden_size_and_state_count(copy, LAYER_IDS, tiny_target):
    ds = copy()
    rel_h = edit(ds, 0, lambda o: o.update(hidden_states=[h[:, :32].clone() for h in o["hidden_states"]]))
    rel_n = edit(ds, 1, lambda o: o.update(hidden_states=o["hidden_states"][:3]))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.HIDDEN_SIZE, rel_h, f"H=32, expected {tiny_config(tiny_target)['hidden_size']}")
    assert_found(report, C.STATE_COUNT, rel_n, "3 hidden states, expected 4")


def test_state_rows_differ_from_tokens(copy):
    ds = copy()
    rel = edit(ds, 5, lambda o: o["hidden_states"].__setitem__(2, o["hidden_states"][2][:-1].clone()))
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.LENGTH_MISMATCH, rel, "slot 2")


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------


def test_mask_all_zero_and_not_binary(copy):
    ds = copy()
    rel0 = edit(ds, 0, lambda o: o["loss_mask"].zero_())
    rel1 = edit(ds, 1, lambda o: o["loss_mask"].__setitem__(slice(0, 3), 2))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.MASK_EMPTY, rel0)
    assert_found(report, C.MASK_VALUES, rel1, "[2]")


def test_token_id_out_of_range(copy):
    ds = copy()
    rel = edit(ds, 2, lambda o: o["input_ids"].__setitem__(5, 100_000))
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.TOKEN_RANGE, rel, "positions 5")


def test_nan_row_names_slot_and_row(copy):
    ds = copy()
    rel = edit(ds, 6, lambda o: o["hidden_states"][1][7].fill_(float("nan")))
    rel2 = edit(ds, 8, lambda o: o["hidden_states"][3][2, 9].fill_(float("inf")))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.NON_FINITE, rel, "slot 1 row 7: NaN")
    assert_found(report, C.NON_FINITE, rel2, "slot 3 row 2: Inf")


def test_all_zero_state_and_zero_rows(copy):
    ds = copy()
    rel = edit(ds, 3, lambda o: o["hidden_states"][0].zero_())
    rel2 = edit(ds, 4, lambda o: o["hidden_states"][2][-5:].zero_())
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.ALL_ZERO, rel, "slot 0 is all zeros")
    assert_found(report, C.ALL_ZERO, rel2, "slot 2: 5 of")


def test_rms_outlier(copy):
    ds = copy()
    rel = edit(ds, 9, lambda o: o["hidden_states"][2].mul_(1000))
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.RMS_BOUNDS, rel, "slot 2")


# ---------------------------------------------------------------------------------------------
# Dataset level
# ---------------------------------------------------------------------------------------------


def test_missing_file_and_side_files_disagree(copy):
    ds = copy()
    sample_path(ds, 10).unlink()
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.MISSING_INDEX, None, "10")
    assert_found(report, C.SAMPLE_LENGTHS, formats.SAMPLE_LENGTHS_FILE, "no file")
    assert_found(report, C.TOKEN_FREQ, formats.TOKEN_FREQ_FILE, "samples have no file (named above)")
    assert_found(report, C.DATA_CONFIG, formats.DATA_CONFIG_FILE, "num_samples is 12, the files hold 11")


def test_a_recorded_max_length_below_the_samples_is_named(copy):
    """data_config.json's max_length lowered below its samples was CLEAN."""
    ds = copy()
    config = formats.read_json(ds / formats.DATA_CONFIG_FILE)
    formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, {**config, "max_length": 8})
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.DATA_CONFIG, formats.DATA_CONFIG_FILE, "max_length is 8, but the files hold a sample of")


def test_duplicate_index_and_folder_naming(copy):
    ds = copy()
    other = ds / formats.HIDDEN_STATES_DIR / "rows_2000-4000"
    other.mkdir()
    shutil.copy(sample_path(ds, 3), other / "data_3.pt")
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.DUPLICATE_INDEX, None, "index 3 appears 2 times")
    assert_found(report, C.FOLDER_NAMING, str(other / "data_3.pt"), "outside its folder")


def test_symlinks_that_loop_or_lead_nowhere(copy):
    """A self-loop, a dangling link and a folder link inside a rows folder are named, not skipped silently."""
    ds = copy()
    rows = sample_path(ds, 5).parent
    sample_path(ds, 5).unlink()
    (rows / "data_5.pt").symlink_to("data_5.pt")  # loops onto itself
    (rows / "data_40.pt").symlink_to("nowhere.pt")
    (rows / "loop").symlink_to(".")
    (rows / "data_6.pt").rename(ds / "elsewhere.pt")
    (rows / "data_6.pt").symlink_to(ds / "elsewhere.pt")  # a link to a real file is a sample like any other
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert not report.clean
    assert_found(report, C.BROKEN_LINK, str(rows / "data_5.pt"), "loops")
    assert_found(report, C.BROKEN_LINK, str(rows / "data_40.pt"), "does not exist")
    assert [p for p in report.problems if p.severity == C.WARNING and "not followed" in p.message]
    assert_found(report, C.MISSING_INDEX, None, "5")
    assert not [p for p in report.problems if p.path.endswith("data_6.pt")]


def test_misnamed_folder(copy):
    ds = copy()
    hs = ds / formats.HIDDEN_STATES_DIR
    (hs / "rows_0-2000").rename(hs / "rows_0-1000")
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.FOLDER_NAMING, None, "rows_0-1000")


def test_sample_lengths_and_token_freq_edited(copy):
    ds = copy()
    lengths = formats.read_sample_lengths(ds / formats.SAMPLE_LENGTHS_FILE)
    lengths[2] += 1
    formats.write_sample_lengths(ds / formats.SAMPLE_LENGTHS_FILE, lengths)
    freq = formats.read_token_freq(ds / formats.TOKEN_FREQ_FILE)
    freq[next(iter(freq))] += 5
    formats.write_token_freq(ds / formats.TOKEN_FREQ_FILE, freq)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.SAMPLE_LENGTHS, formats.SAMPLE_LENGTHS_FILE, "sample 2: recorded length")
    assert_found(report, C.TOKEN_FREQ, formats.TOKEN_FREQ_FILE, "1 token ids", "so this file is what changed")


def test_token_freq_disagreement_names_the_files_holding_the_token(copy):
    """A file's mask edited: token_freq.pt's disagreement names the files that hold the token, and
    the edited file is named by its own token digest."""
    ds = copy()
    path = sample_path(ds, 4)
    obj = torch.load(path, weights_only=True)
    masked = obj["loss_mask"].nonzero().flatten()
    token = int(obj["input_ids"][masked[0]])
    obj["loss_mask"][obj["input_ids"] == token] = 0
    torch.save(obj, path)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    rel = str(path.relative_to(ds))
    assert_found(report, C.STATE_SIGNATURE, rel, "input_ids or loss_mask are not what extraction wrote")
    hit = assert_found(report, C.TOKEN_FREQ, formats.TOKEN_FREQ_FILE, "changed since the counts were made")
    holders = []
    for p in sorted((ds / formats.HIDDEN_STATES_DIR).rglob("data_*.pt")):
        o = torch.load(p, weights_only=True)
        if token in o["input_ids"][o["loss_mask"] == 1].tolist():
            holders.append(str(p.relative_to(ds)))
    assert f"1 token ids (e.g. id {token}:" in hit.message  # only that token's count moved
    assert (f"in {holders[0]}" if holders else "in no file") in hit.message


@pytest.mark.parametrize(
    "change, kind, words",
    [
        (
            lambda o: o.update(input_ids=o["input_ids"].int()),
            C.WRONG_DTYPE,
            "input_ids is int32: the layout stores int64",
        ),
        (lambda o: o.update(loss_mask=o["loss_mask"].int()), C.WRONG_DTYPE, "loss_mask is int32"),
        (lambda o: o.update(hidden_states=tuple(o["hidden_states"])), C.WRONG_SHAPE, "hidden_states is a tuple"),
        (
            lambda o: o["hidden_states"].__setitem__(0, o["hidden_states"][0].to_sparse()),
            C.WRONG_DTYPE,
            "sparse_coo tensor: the layout stores dense",
        ),
    ],
)
def test_a_file_stored_in_another_kind_than_its_layout_is_named(copy, change, kind, words):
    """int32 ids, a tuple of states (CLEAN, and trained on), a sparse state (check ended in a raw
    error naming no file): each a finding about that file."""
    ds = copy()
    rel = edit(ds, 4, change)
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), kind, rel, words)


@pytest.mark.parametrize("value", ['"35"', "35.0", "true"])
def test_sample_lengths_that_are_no_counts_are_named(copy, value):
    ds = copy()
    path = ds / formats.SAMPLE_LENGTHS_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "3": json.loads(value)}))
    with pytest.raises(
        ValueError,
        match=rf"sample_lengths.json: .*'3': {re.escape(repr(json.loads(value)))} "
        r"are no index: token count",
    ):
        formats.read_sample_lengths(path)
    assert not C.check_dataset(CheckOptions(path=ds, use_target=False)).clean


def test_data_config_missing_or_inconsistent(copy, LAYER_IDS):
    ds = copy()
    (ds / formats.DATA_CONFIG_FILE).unlink()
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)), C.DATA_CONFIG, formats.DATA_CONFIG_FILE, "missing"
    )
    ds2 = copy("ds2")
    cfg = formats.read_json(ds2 / formats.DATA_CONFIG_FILE)
    cfg["hidden_size"] = 128
    formats.write_json_atomic(ds2 / formats.DATA_CONFIG_FILE, cfg)
    assert len(found(C.check_dataset(CheckOptions(path=ds2, use_target=False)), C.HIDDEN_SIZE)) == 12 * len(LAYER_IDS)


# ---------------------------------------------------------------------------------------------
# Layer identity and the chat template (need the target)
# ---------------------------------------------------------------------------------------------


def test_swapped_layers_are_named(copy):
    ds = copy()
    for i in range(12):
        edit(ds, i, lambda o: o.update(hidden_states=[o["hidden_states"][k] for k in (0, 2, 1, 3)]))
    report = C.check_dataset(CheckOptions(path=ds))
    assert_found(report, C.LAYER_IDENTITY, None, "slot 1 matches layer 4, not 3", "slot 2 matches layer 3, not 4")


# ---------------------------------------------------------------------------------------------
# Every file's states against the signatures extraction recorded (no target needed)
# ---------------------------------------------------------------------------------------------


def neighbour_states(tiny_target: Path, ds: Path, i: int, layer: int) -> torch.Tensor:
    """Sample i's states at `layer` as extraction computes them (fp32, stored in bf16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    ids = torch.load(sample_path(ds, i), weights_only=True)["input_ids"]
    with torch.no_grad():
        return model(ids[None], output_hidden_states=True).hidden_states[layer][0].to(torch.bfloat16)


def test_a_neighbouring_layer_in_one_slot_of_one_file_is_named(copy, tiny_target, LAYER_IDS):
    """Slot 1 of one file holds layer 4 in place of layer 3 (the ninth probe's case): every
    per-slot scale stays in range, and without the target only the recorded signature tells."""
    ds = copy()
    rel = edit(ds, 5, lambda o: o["hidden_states"].__setitem__(1, neighbour_states(tiny_target, ds, 5, 4)))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(
        report, C.LAYER_IDENTITY, rel, "slot 1 (layer 3) holds the states extraction wrote in slot 2 (layer 4)"
    )
    assert {p.path for p in report.errors} == {rel}
    shutil.rmtree(ds / formats.SIGNATURES_DIR)  # switching the check off is not silent
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.STATE_SIGNATURE, "signatures", "missing")
    cfg = formats.read_json(ds / formats.DATA_CONFIG_FILE)
    del cfg["state_signatures"]  # one of the two fields deleted by hand: the other still records the log
    formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, cfg)
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.STATE_SIGNATURE, "signatures", "missing")
    del cfg["signature_key"]  # a dataset made without them: what the scales alone say is nothing
    formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, cfg)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert report.clean  # and says the state check was off
    assert [p for p in report.problems if p.kind == C.STATE_SIGNATURE and "records no signature log" in p.message]


def test_a_log_kept_without_its_key_or_its_format_still_vouches_for_nothing_copied_in(copy):
    """The twelfth probe: with signature_key deleted, lines copied from another dataset vouched for
    their files; with format (or state_signatures) deleted, a file without a line was a warning."""
    ds = copy()
    log = next((ds / formats.SIGNATURES_DIR).glob("*.jsonl"))
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(line for line in lines if json.loads(line)["index"] != 5))
    cfg = formats.read_json(ds / formats.DATA_CONFIG_FILE)
    for field in ("format", "state_signatures", "edited format"):
        edited = {k: v for k, v in cfg.items() if k != field}
        if field == "edited format":  # the thirteenth probe: another layout's name switched the rule off
            edited["format"] = formats.FORMAT_V1_FLAT
        formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, edited)
        report = C.check_dataset(CheckOptions(path=ds, use_target=False))
        assert_found(report, C.STATE_SIGNATURE, formats.v1_relative_path(5), "no signature line vouches")
    formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, {k: v for k, v in cfg.items() if k != "signature_key"})
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.STATE_SIGNATURE, formats.DATA_CONFIG_FILE, "no signature_key")


@pytest.mark.parametrize(
    "change, kind, words",
    [
        (
            lambda h: [h[0], h[2], h[1], h[3]],
            C.LAYER_IDENTITY,
            "slot 2 (layer 4) holds the states extraction wrote in slot 1",
        ),
        (lambda h: [h[0], h[1], h[2] * 1.01, h[3]], C.STATE_SIGNATURE, "slot 2 (layer 4) is not what extraction wrote"),
        (lambda h: [h[0], h[1].roll(1, 0), h[2], h[3]], C.STATE_SIGNATURE, "slot 1 (layer 3) is not what"),
    ],
)
def test_a_slot_other_than_extraction_wrote_is_named_in_any_file(copy, change, kind, words):
    ds = copy()
    rel = edit(ds, 7, lambda o: o.update(hidden_states=change(o["hidden_states"])))
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), kind, rel, words)


def test_tokens_shifted_against_their_states_are_named(copy):
    ds = copy()
    rel = edit(ds, 3, lambda o: o.update(input_ids=o["input_ids"].roll(1), loss_mask=o["loss_mask"].roll(1)))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.STATE_SIGNATURE, rel, "input_ids or loss_mask are not what extraction wrote")


def test_a_file_no_line_vouches_for_or_an_unreadable_record_is_named(copy):
    """Where data_config.json records the log, a file without its line is damage, not a warning:
    the probe removed one file's line and put another layer in that file, which check called CLEAN."""
    ds = copy()
    log = next((ds / formats.SIGNATURES_DIR).glob("*.jsonl"))
    lines = log.read_text().splitlines(keepends=True)
    index_of = [json.loads(line)["index"] for line in lines]
    log.write_text("".join(line for line, i in zip(lines, index_of) if i != 4))
    edit(ds, 4, lambda o: o["hidden_states"].__setitem__(1, o["hidden_states"][2].clone()))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.STATE_SIGNATURE, formats.v1_relative_path(4), "no signature line vouches for this file")
    log.write_text("".join(lines) + lines[0].replace(f'"index": {index_of[0]},', '"index": 9999,'))
    assert_found(C.check_dataset(CheckOptions(path=ds, use_target=False)), C.STATE_SIGNATURE, "signatures", "9999")
    log.write_text("".join(lines[:2]) + "{not json\n" + "".join(lines[2:]))
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)),
        C.STATE_SIGNATURE,
        f"{formats.SIGNATURES_DIR}/{log.name}:3",
        "unreadable line",
    )
    log.write_text("")  # an emptied log vouches for no file
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)), C.STATE_SIGNATURE, formats.v1_relative_path(7)
    )


def test_another_extractions_files_and_lines_copied_in_are_named(copy):
    """The probe copied five files of a dataset made from another target, with their lines put in
    a log of their own: check and train took them. A line carries its extraction's key."""
    ds = copy()
    rel = edit(ds, 6, lambda o: o.update(hidden_states=[h * 1.5 for h in o["hidden_states"]]))
    obj = torch.load(ds / rel, weights_only=True)
    other = formats.SignatureLog(ds, "shard_0_of_9", "0000000000000000")  # another dataset's key
    other.record(
        6, formats.state_signature(obj["hidden_states"]), formats.token_digest(obj["input_ids"], obj["loss_mask"])
    )
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.STATE_SIGNATURE, f"{formats.SIGNATURES_DIR}/shard_0_of_9.jsonl", "another extraction")
    assert_found(report, C.STATE_SIGNATURE, rel, "is not what extraction wrote")
    assert not [p for p in report.problems if p.path == rel and p.severity == C.WARNING]


def test_layer_ids_off_by_one(copy, LAYER_IDS):
    ds = copy()
    cfg = formats.read_json(ds / formats.DATA_CONFIG_FILE)
    cfg["layer_ids"] = [1, 2, 3, LAYER_IDS[-1]]
    formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, cfg)
    report = C.check_dataset(CheckOptions(path=ds))
    assert_found(report, C.LAYER_IDENTITY, None, "slot 0 matches layer 2, not 1", "slot 2 matches layer 4, not 3")


def test_data_config_with_two_aux_layers_is_refused(copy, LAYER_IDS):
    """`eaglet extract --layer-ids A,B,LAST` is refused at extraction; a config that records such
    ids anyway must not pass check (the drafter's fc fuses exactly three aux states)."""
    ds = copy()
    cfg = formats.read_json(ds / formats.DATA_CONFIG_FILE)
    cfg["layer_ids"] = [LAYER_IDS[0], LAYER_IDS[2], LAYER_IDS[3]]
    formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, cfg)
    report = C.check_dataset(CheckOptions(path=ds))
    assert_found(report, C.DATA_CONFIG, formats.DATA_CONFIG_FILE, "expected 4 integer ids: the 3 aux ids")


def test_post_norm_last_state_where_pre_norm_recorded(copy, tiny_target, LAYER_IDS):
    from transformers import AutoModelForCausalLM

    norm = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).model.norm
    ds = copy()
    for i in range(12):

        def to_post_norm(o):
            with torch.no_grad():
                o["hidden_states"][3] = norm(o["hidden_states"][3].float()).to(torch.bfloat16)

        edit(ds, i, to_post_norm)
    report = C.check_dataset(CheckOptions(path=ds))
    p = assert_found(
        report, C.LAYER_IDENTITY, None, f"slot 3 (last) matches layer {LAYER_IDS[-1]} post-norm, recorded pre_norm"
    )
    assert p.path.endswith(".pt")


def test_shifted_mask_does_not_match_template(copy):
    ds = copy()
    rel = edit(ds, 1, lambda o: o.update(loss_mask=torch.roll(o["loss_mask"], 1)))
    report = C.check_dataset(CheckOptions(path=ds))
    assert_found(report, C.MASK_TEMPLATE, rel, "does not start after the generation prompt")
    assert found(report, C.MASK_TEMPLATE)[0].path == rel  # only the edited file


def test_user_turn_masked(copy):
    ds = copy()
    rel = edit(ds, 0, lambda o: o.update(loss_mask=1 - o["loss_mask"]))
    assert_found(C.check_dataset(CheckOptions(path=ds)), C.MASK_TEMPLATE, rel)


# ---------------------------------------------------------------------------------------------
# Foreign formats
# ---------------------------------------------------------------------------------------------


def load_clean_samples(clean: Path) -> list[formats.V1Sample]:
    files = formats.list_v1_files(clean)
    return [formats.read_v1_sample(files[i]) for i in sorted(files)]


def test_flat_v1_layout(clean, tmp_path):
    ds = tmp_path / "flat"
    for i, s in enumerate(load_clean_samples(clean)):
        write_flat_v1_sample(ds, i, s)
    for side in (formats.DATA_CONFIG_FILE, formats.SAMPLE_LENGTHS_FILE, formats.TOKEN_FREQ_FILE):
        shutil.copy(clean / side, ds / side)
    report = C.check_dataset(CheckOptions(path=ds))
    assert report.format == formats.FORMAT_V1_FLAT
    assert report.clean, report.lines()
    assert all(s.best == s.expected for s in report.identity) and len(report.identity) == 4


@pytest.mark.parametrize("compressed", [False, True])
def test_specforge_layout(clean, tmp_path, tiny_target, compressed, LAYER_IDS):
    from transformers import AutoModelForCausalLM

    norm = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).model.norm
    ds = tmp_path / "specforge"
    for i, s in enumerate(load_clean_samples(clean)):
        with torch.no_grad():  # SpecForge stores the last state after the final norm
            last = norm(s.hidden_states[3].float()).to(torch.bfloat16)
        write_specforge_sample(
            ds, i, s.input_ids, s.loss_mask, last, torch.cat(s.hidden_states[:3], dim=-1), compressed=compressed
        )
    # No data_config: expectations come from the first file; layer ids passed via a config-less target run.
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert report.format == formats.FORMAT_SPECFORGE
    assert report.clean, report.lines()
    assert report.files == 12 and len(report.slots) == 4 and report.masked_tokens > 0
    # With the target and the layer ids recorded, the post-norm last state is recognized as such.
    cfg = tiny_config(tiny_target)
    formats.write_json_atomic(
        ds / formats.DATA_CONFIG_FILE,
        {
            "layer_ids": LAYER_IDS,
            "hidden_size": cfg["hidden_size"],
            "hidden_states_dtype": "bfloat16",
            "vocab_size": cfg["vocab_size"],
            "last_hidden_state": "post_norm",
        },
    )
    report = C.check_dataset(CheckOptions(path=ds, target=str(tiny_target)))
    assert report.clean, report.lines()
    assert report.identity[3].expected == report.identity[3].best == f"layer {LAYER_IDS[-1]} post-norm"
    # A NaN in an aux slot is named by slot (aux_hidden_state's second third is slot 1).
    path = ds / formats.specforge_relative_path(4, compressed)
    obj = formats.read_specforge_sample(path)
    obj["aux_hidden_state"][3, obj["hidden_state"].shape[-1] + 5] = float("nan")
    write_specforge_sample(
        ds, 4, obj["input_ids"], obj["loss_mask"], obj["hidden_state"], obj["aux_hidden_state"], compressed=compressed
    )
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)),
        C.NON_FINITE,
        formats.specforge_relative_path(4, compressed),
        "slot 1 row 3: NaN",
    )
    # ids stored narrower than the vocabulary needs were taken as they are (CLEAN), then a raw torch error
    for dtype in (torch.uint8, torch.int16):
        write_specforge_sample(
            ds,
            5,
            obj["input_ids"].to(dtype),
            obj["loss_mask"],
            obj["hidden_state"],
            obj["aux_hidden_state"],
            compressed=compressed,
        )
        assert_found(
            C.check_dataset(CheckOptions(path=ds, use_target=False)),
            C.WRONG_DTYPE,
            formats.specforge_relative_path(5, compressed),
            f"input_ids is {str(dtype).removeprefix('torch.')}: the layout stores int64 or int32",
        )
    for i in range(12):  # with the target too (its identity sample reads some of them), named, not a raw error
        o = formats.read_specforge_sample(ds / formats.specforge_relative_path(i, compressed))
        write_specforge_sample(
            ds,
            i,
            o["input_ids"].to(torch.int16),
            o["loss_mask"],
            o["hidden_state"],
            o["aux_hidden_state"],
            compressed=compressed,
        )
    assert_found(
        C.check_dataset(CheckOptions(path=ds, target=str(tiny_target))),
        C.WRONG_DTYPE,
        formats.specforge_relative_path(0, compressed),
        "input_ids is int16",
    )


def test_specforge_truncated_gz(clean, tmp_path):
    ds = tmp_path / "sfgz"
    for i, s in enumerate(load_clean_samples(clean)[:3]):
        write_specforge_sample(
            ds, i, s.input_ids, s.loss_mask, s.hidden_states[3], torch.cat(s.hidden_states[:3], dim=-1), compressed=True
        )
    path = ds / formats.specforge_relative_path(1, True)
    path.write_bytes(path.read_bytes()[:300])
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)), C.UNREADABLE, formats.specforge_relative_path(1, True)
    )


def test_speculators_safetensors_layout(clean, tmp_path):
    ds = tmp_path / "hs"
    for i, s in enumerate(load_clean_samples(clean)):
        formats.write_hs_safetensors_sample(
            ds, i, s.input_ids, torch.stack(s.hidden_states, dim=1), s.loss_mask if i % 2 else None
        )  # loss_mask is optional there
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert report.format == formats.FORMAT_HS_SAFETENSORS
    assert report.clean, report.lines()
    assert report.files == 12 and len(report.slots) == 4
    # One file with 3 states instead of 4, one truncated.
    s = load_clean_samples(clean)[2]
    formats.write_hs_safetensors_sample(ds, 2, s.input_ids, torch.stack(s.hidden_states[:3], dim=1))
    (ds / "hs_5.safetensors").write_bytes((ds / "hs_5.safetensors").read_bytes()[:200])
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.STATE_COUNT, "hs_2.safetensors", "3 hidden states, expected 4")
    assert_found(report, C.UNREADABLE, "hs_5.safetensors")


def test_no_dataset(tmp_path):
    report = C.check_dataset(CheckOptions(path=tmp_path, use_target=False))
    assert report.format is None and found(report, C.NO_FILES)
    assert run_cli(str(tmp_path)) == 1


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def test_mask_template_issues_pure():
    gen, eot = [1, 9], frozenset({2})
    ids = [1, 5, 6, 2, 1, 9, 7, 8, 2, 3]
    good = [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    assert check_files.mask_template_issues(ids, good, gen, eot) == []
    shifted = [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert len(check_files.mask_template_issues(ids, shifted, gen, eot)) == 2  # wrong start; assistant turn unmasked
    truncated_ids, truncated = ids[:8], good[:8]  # cut at max_length inside the reply: fine
    assert check_files.mask_template_issues(truncated_ids, truncated, gen, eot) == []


def test_length_histogram():
    histogram = check_dataset_module.length_histogram([1, 63, 64, 127, 128, 1000])
    assert histogram == {"0-63": 2, "64-127": 2, "128-255": 1, "512-1023": 1}


# ---------------------------------------------------------------------------------------------
# Every file's slots against the dataset's typical scales (SmolLM2's real states)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_data(smollm2_dir, tmp_path_factory) -> Path:
    from eaglet.extract import extract
    from eaglet.prepare import prepare

    root = tmp_path_factory.mktemp("slots")
    prepare(PrepareOptions(target=None, data="sharegpt", out=root / "prepared", num_samples=8, max_length=128))
    extract(ExtractOptions(prepared=root / "prepared", out=root / "data", dtype="fp32"), show_progress=False)
    return root / "data"


def tampered(data: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    path = sorted(formats.list_v1_files(copy).values())[3]
    sample = torch.load(path, weights_only=True)
    sample["hidden_states"] = change(list(sample["hidden_states"]))
    torch.save(sample, path)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, slots",
    [
        (lambda h: [h[0], h[2], h[1], h[3]], {1, 2}),  # aux slots swapped in one file
        (lambda h: [h[0], h[1], h[3], h[2]], {2, 3}),  # the last state swapped with the aux one next to it
        (lambda h: [h[1], h[0], h[2], h[3]], {0, 1}),
        (lambda h: [h[0], h[2], h[2], h[3]], {1}),  # a slot filled from another layer
    ],
)
def test_one_file_with_another_layer_in_a_slot_is_caught_in_every_file(smollm2_data, tmp_path, change, slots):
    """Without the target and in every file (not a sample): each slot's scale against the
    dataset's typical scale for it; train runs the same check before its first step."""
    assert C.check_dataset(CheckOptions(path=smollm2_data, use_target=False)).clean
    report = C.check_dataset(CheckOptions(path=tampered(smollm2_data, tmp_path, change), use_target=False))
    found = {int(p.message.split()[1]) for p in report.errors if p.kind == C.LAYER_IDENTITY}
    # the file is refused, for a slot it changed (a slot whose scale varies much from file to file,
    # as the last layer's does, may not be named itself when it holds a steadier layer's states)
    assert not report.clean and found and found <= slots, [p.message for p in report.errors]


def test_a_recorded_vocab_size_other_than_the_targets(copy):
    """train refuses such a dataset at its start: check says so first, naming the file."""
    ds = copy()
    cfg = formats.read_json(ds / formats.DATA_CONFIG_FILE)
    cfg["vocab_size"] += 1
    formats.write_json_atomic(ds / formats.DATA_CONFIG_FILE, cfg)
    assert_found(
        C.check_dataset(CheckOptions(path=ds)),
        C.LAYER_IDENTITY,
        formats.DATA_CONFIG_FILE,
        "vocab_size",
        "is not the target's",
    )


def test_a_recorded_count_costs_no_memory_and_an_unknown_format_is_named(copy):
    """num_samples 10^11 in data_config.json once made check list every missing index (23 GB);
    a format no layout has passed unnoticed with --no-target."""
    ds = copy()
    cfg = json.loads((ds / formats.DATA_CONFIG_FILE).read_text())
    (ds / formats.DATA_CONFIG_FILE).write_text(json.dumps({**cfg, "num_samples": 10**11, "format": "weird"}))
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.MISSING_INDEX, "", f"{10**11 - 12} of {10**11} indices have no file: 12, 13,")
    assert_found(report, C.DATA_CONFIG, formats.DATA_CONFIG_FILE, "format 'weird' is no layout eaglet knows")


def test_two_records_of_the_layers_must_agree(copy):
    """aux_layer_ids [0, 1, 2] beside layer_ids [2, 3, 4, N] passed as CLEAN."""
    ds = copy()
    cfg = json.loads((ds / formats.DATA_CONFIG_FILE).read_text())
    (ds / formats.DATA_CONFIG_FILE).write_text(json.dumps({**cfg, "aux_layer_ids": [0, 1, 2]}))
    assert_found(
        C.check_dataset(CheckOptions(path=ds, use_target=False)),
        C.DATA_CONFIG,
        formats.DATA_CONFIG_FILE,
        "aux_layer_ids [0, 1, 2] are not layer_ids",
    )


def test_a_pipe_named_like_a_sample_file_is_named_not_opened(copy):
    """A FIFO named data_5.pt was only a missing index 5; opening it would block forever."""
    import os

    ds = copy()
    path = sample_path(ds, 5)
    path.unlink()
    os.mkfifo(path)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.BROKEN_LINK, str(path), "a pipe, socket or device, not a file")


def test_a_file_its_signature_vouches_for_is_not_refused_for_an_unusual_scale(copy):
    """A fresh extraction was refused: one short sample's slot 1 had about slot 2's scale, so the
    per-file scale test called it swapped, though its signature (and the target) said it was right."""
    ds = copy()
    rms = lambda x: float(x.float().pow(2).mean(1).sqrt().median())  # noqa: E731
    scales = [
        [rms(x) for x in torch.load(p, weights_only=True)["hidden_states"]] for p in sorted(ds.rglob("data_*.pt"))
    ]
    typical = [sorted(col)[len(col) // 2] for col in zip(*scales)]
    j, k = 0, max(range(1, len(typical)), key=lambda k: typical[k] / typical[0])  # the slots most apart

    def at_the_other_slots_scale(o):
        h = o["hidden_states"]
        h[j] = (h[j].float() * (typical[k] / rms(h[j]))).to(h[j].dtype)

    rel = edit(ds, 6, at_the_other_slots_scale)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert_found(report, C.LAYER_IDENTITY, rel, f"slot {j} (layer 2) has the scale of slot {k}")
    # as if extraction had written these very states (a sample whose slot is that loud)
    obj = torch.load(ds / rel, weights_only=True)
    key = formats.read_json(ds / formats.DATA_CONFIG_FILE)["signature_key"]
    formats.SignatureLog(ds, "shard_0_of_1", key).record(
        6, formats.state_signature(obj["hidden_states"]), formats.token_digest(obj["input_ids"], obj["loss_mask"])
    )
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert report.clean, [(p.kind, p.path, p.message) for p in report.errors]


def test_low_next_token_agreement_names_the_file_that_agrees_least(copy):
    """It named the last file sampled, whatever file was wrong."""
    ds = copy()
    rel = edit(ds, 0, lambda o: o["hidden_states"].__setitem__(3, -o["hidden_states"][3]))
    report = C.check_dataset(CheckOptions(path=ds, identity_samples=2))
    hits = [p for p in report.errors if "next-token argmax agrees" in p.message]
    assert hits and hits[0].path == rel and "this file agrees least" in hits[0].message, report.problems
