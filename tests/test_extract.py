"""Hidden-state extraction on a tiny random Llama, checked against the target's own
`output_hidden_states`; resume after kill -9; shards; padding never leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglet import formats
from eaglet.prepare import prepare
from eaglet.extract import extract, length_batches
from eaglet.options import ExtractOptions, PrepareOptions

LAYER_IDS = [2, 4, 5, 8]  # tiny target has 8 layers: default ids [2, N//2, N-3, N]


@pytest.fixture
def prepared(tiny_target, chats_jsonl, tmp_path) -> Path:
    out = tmp_path / "prep"
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=out, max_length=512))
    return out


def load_all(out: Path) -> dict[int, formats.V1Sample]:
    return {i: formats.read_v1_sample(p) for i, p in formats.list_v1_files(out).items()}


def reference_states(target: Path, input_ids: list[int], dtype=torch.float32) -> list[torch.Tensor]:
    """Independent reference: HF output_hidden_states of the sample alone. Id N in HF is
    after the final norm, so the reference for the stored (pre-norm) last state is checked
    by applying the norm to the stored one."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], model


def test_v1_files_match_output_hidden_states(tiny_target, prepared, tmp_path):
    out = tmp_path / "data"
    extract(
        ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), dtype="fp32", store_dtype="fp32"),
        show_progress=False,
    )
    samples, _ = formats.read_prepared(prepared)
    files = load_all(out)
    assert sorted(files) == list(range(len(samples)))
    for i in (0, 5, 11):
        s = files[i]
        assert s.input_ids.tolist() == samples[i].input_ids and s.loss_mask.tolist() == samples[i].loss_mask
        ref, model = reference_states(tiny_target, samples[i].input_ids)
        for slot, layer_id in enumerate(LAYER_IDS[:-1]):
            torch.testing.assert_close(s.hidden_states[slot], ref[layer_id], rtol=1e-5, atol=1e-5)
        # Stored last state is pre-norm: norm(stored) equals HF's (post-norm) last entry, and
        # the stored one itself does not.
        with torch.no_grad():
            torch.testing.assert_close(model.model.norm(s.hidden_states[-1]), ref[8], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(s.hidden_states[-1], ref[8], atol=1e-3)


def test_v1_schema_and_side_files(tiny_target, prepared, tmp_path):
    out = tmp_path / "data"
    summary = extract(ExtractOptions(prepared=prepared, out=out, target=str(tiny_target)), show_progress=False)
    path = out / "hidden_states" / "rows_0-2000" / "data_3.pt"
    raw = torch.load(path, weights_only=True)
    assert list(raw) == ["input_ids", "hidden_states", "loss_mask"]
    T = raw["input_ids"].shape[0]
    assert raw["input_ids"].dtype == torch.int64 and raw["loss_mask"].dtype == torch.int64
    assert raw["loss_mask"].shape == (T,)
    assert len(raw["hidden_states"]) == 4
    assert all(h.dtype == torch.bfloat16 and h.shape == (T, 64) for h in raw["hidden_states"])
    cfg = formats.read_json(out / "data_config.json")
    samples, pcfg = formats.read_prepared(prepared)
    assert cfg["layer_ids"] == LAYER_IDS and cfg["aux_layer_ids"] == LAYER_IDS[:-1]
    assert cfg["last_hidden_state"] == "pre_norm" and cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 8
    assert cfg["num_samples"] == len(samples) and cfg["num_tokens"] == sum(len(s.input_ids) for s in samples)
    assert (
        cfg["target_revision"] == pcfg["target_revision"]
        and cfg["chat_template_sha256"] == pcfg["chat_template_sha256"]
    )
    for key in (
        "architecture",
        "vocab_size",
        "layer_id_convention",
        "hidden_states_dtype",
        "max_length",
        "eaglet_version",
        "command",
        "target",
    ):
        assert key in cfg
    lengths = formats.read_sample_lengths(out / "sample_lengths.json")
    assert lengths == {i: len(s.input_ids) for i, s in enumerate(samples)}
    assert formats.read_token_freq(out / "token_freq.pt") == formats.read_token_freq(prepared / "token_freq.pt")
    # bf16 states + int64 ids and mask, plus a small pickle header per file.
    assert summary.bytes_on_disk / summary.tokens_on_disk < formats.v1_min_bytes_per_token(64) + 1500 / 20


def test_padded_batch_equals_each_sample_alone(tiny_target, prepared, tmp_path):
    batched, alone = tmp_path / "batched", tmp_path / "alone"
    extract(
        ExtractOptions(
            prepared=prepared, out=batched, target=str(tiny_target), dtype="fp32", store_dtype="fp32", max_batch_size=12
        ),
        show_progress=False,
    )
    extract(
        ExtractOptions(
            prepared=prepared, out=alone, target=str(tiny_target), dtype="fp32", store_dtype="fp32", max_batch_size=1
        ),
        show_progress=False,
    )
    a, b = load_all(batched), load_all(alone)
    assert len({len(s.input_ids) for s in a.values()}) > 3  # lengths really differ, so padding happened
    for i in a:
        assert torch.equal(a[i].input_ids, b[i].input_ids) and torch.equal(a[i].loss_mask, b[i].loss_mask)
        for x, y in zip(a[i].hidden_states, b[i].hidden_states):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_length_batches_respect_budget():
    lengths = [10, 500, 30, 31, 29, 800, 5]
    batches = length_batches(list(range(len(lengths))), lengths, batch_tokens=100, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 100)


def test_rerun_redoes_missing_and_partial_files_only(tiny_target, prepared, tmp_path):
    out = tmp_path / "data"
    extract(ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), max_batch_size=1), show_progress=False)
    before = {i: p.stat().st_mtime_ns for i, p in formats.list_v1_files(out).items()}
    victim = formats.list_v1_files(out)[4]
    reference = formats.read_v1_sample(victim)
    victim.unlink()
    stale = victim.parent / f".{victim.name}{formats.TMP_MARK}abc123"
    stale.write_bytes(b"half a file")
    summary = extract(
        ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), max_batch_size=1), show_progress=False
    )
    assert summary.written == 1 and summary.already_done == len(before) - 1
    assert not stale.exists()
    after = formats.list_v1_files(out)
    assert {i: p.stat().st_mtime_ns for i, p in after.items() if i != 4} == {i: t for i, t in before.items() if i != 4}
    redone = formats.read_v1_sample(after[4])
    assert all(torch.equal(x, y) for x, y in zip(redone.hidden_states, reference.hidden_states))


def test_rerun_with_other_settings_is_refused(tiny_target, prepared, tmp_path):
    out = tmp_path / "data"
    extract(ExtractOptions(prepared=prepared, out=out, target=str(tiny_target)), show_progress=False)
    with pytest.raises(ValueError, match="layer_ids"):
        extract(
            ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), layer_ids=[1, 3, 5, 8]),
            show_progress=False,
        )


@pytest.mark.parametrize(
    "ids,msg",
    [
        ([2, 3, 4, 5], "last id must be 8"),
        ([3, 2, 5, 8], "strictly increasing"),
        ([0, 3, 5, 8], r"ids in 1\.\.7 for this 8-layer target"),
        ([8], "the 3 aux ids EAGLE-3 fuses, then the last layer N"),
        ([2, 5, 8], "the 3 aux ids EAGLE-3 fuses"),
        ([1, 2, 3, 5, 8], "expected 4 integer ids"),
    ],
)
def test_bad_layer_ids(tiny_target, prepared, tmp_path, ids, msg):
    with pytest.raises(ValueError, match=msg):
        extract(
            ExtractOptions(prepared=prepared, out=tmp_path / "d", target=str(tiny_target), layer_ids=ids),
            show_progress=False,
        )


def test_other_target_than_prepared_with_is_refused(tiny_target, prepared, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_target.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = (tiny_target / "config.json").read_text()
    (other / "config.json").write_text(config.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    with pytest.raises(ValueError, match="not the one"):
        extract(ExtractOptions(prepared=prepared, out=tmp_path / "d", target=str(other)), show_progress=False)


def test_shards_fill_one_folder_like_a_single_run(tiny_target, prepared, tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    extract(
        ExtractOptions(prepared=prepared, out=single, target=str(tiny_target), max_batch_size=1), show_progress=False
    )
    for shard in range(3):
        s = extract(
            ExtractOptions(
                prepared=prepared, out=sharded, target=str(tiny_target), max_batch_size=1, num_shards=3, shard_id=shard
            ),
            show_progress=False,
        )
        assert s.written == 4
    a, b = load_all(single), load_all(sharded)
    assert sorted(a) == sorted(b)
    for i in a:
        assert all(torch.equal(x, y) for x, y in zip(a[i].hidden_states, b[i].hidden_states))


def test_shard_options_name_the_option_at_fault(tiny_target, prepared, tmp_path):
    with pytest.raises(ValueError, match=r"^--num-shards 0: must be >= 1$"):
        extract(
            ExtractOptions(prepared=prepared, out=tmp_path / "d", target=str(tiny_target), num_shards=0),
            show_progress=False,
        )
    with pytest.raises(ValueError, match=r"--shard-id 3 must be in \[0, --num-shards 3\)"):
        extract(
            ExtractOptions(prepared=prepared, out=tmp_path / "d", target=str(tiny_target), num_shards=3, shard_id=3),
            show_progress=False,
        )
    assert not (tmp_path / "d").exists()  # refused before anything is written


def test_python_dash_m_eaglet_is_the_command():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "eaglet", "eval", "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert '{"prompt"}' in res.stdout and "{{" not in res.stdout


def test_rerun_redoes_files_that_are_not_complete_safe_samples(tiny_target, prepared, tmp_path, caplog):
    """A 0-byte file and an unsafe pickle in the output are not 'already done': a rerun writes them
    again, and they equal a clean run's files. A whole sample of another length is no file of
    this dataset's (another's, behind a link, say): refused and left whole until moved away."""
    import logging

    out = tmp_path / "data"
    extract(ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), max_batch_size=1), show_progress=False)
    files = formats.list_v1_files(out)
    reference = {i: formats.read_v1_sample(files[i]) for i in (0, 1, 2)}
    files[0].write_bytes(b"")
    torch.save({"payload": Path("x")}, files[1])  # a global weights_only refuses to load
    short = formats.read_v1_sample(files[2])
    formats.write_v1_sample(
        out,
        2,
        formats.V1Sample(
            short.input_ids[:-1].clone(), [h[:-1].clone() for h in short.hidden_states], short.loss_mask[:-1].clone()
        ),
    )
    other = files[2].read_bytes()
    with pytest.raises(FileExistsError, match=r"data_2.pt: a whole sample of other shapes"):
        extract(
            ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), max_batch_size=1), show_progress=False
        )
    assert files[2].read_bytes() == other and files[0].read_bytes() == b""  # nothing written
    files[2].unlink()  # moved away, as the message says
    with caplog.at_level(logging.WARNING):
        s = extract(
            ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), max_batch_size=1), show_progress=False
        )
    assert s.written == 3 and "2 existing file(s) are not complete safe samples" in caplog.text
    for i, ref in reference.items():
        again = formats.read_v1_sample(files[i])
        assert torch.equal(again.input_ids, ref.input_ids)
        assert all(torch.equal(a, b) for a, b in zip(again.hidden_states, ref.hidden_states))


def test_kill_9_mid_run_then_resume(tiny_target, tmp_path):
    """Kill a real extraction process at a random moment; every file left is complete, and
    the resumed run gives exactly what an uninterrupted run gives."""
    import json

    chats = tmp_path / "many.jsonl"
    words = "The quick brown fox jumps over the lazy dog. "
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"q{n}"},
                        {"role": "assistant", "content": words * (20 + n % 30)},
                    ]
                }
            )
            + "\n"
            for n in range(400)
        )
    )
    prep = tmp_path / "prep"
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats), out=prep, max_length=1024))
    out, ref = tmp_path / "killed", tmp_path / "ref"
    cmd = [
        sys.executable,
        "-m",
        "eaglet.cli",
        "extract",
        "--prepared",
        str(prep),
        "--out",
        str(out),
        "--target",
        str(tiny_target),
        "--max-batch-size",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while len(formats.list_v1_files(out)) < 60 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = formats.list_v1_files(out)
    assert 0 < len(partial) < 400, "the process must be killed mid-run"
    for path in partial.values():
        formats.read_v1_sample(path)  # every file present is complete and loads
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    extract(ExtractOptions(prepared=prep, out=ref, target=str(tiny_target), max_batch_size=1), show_progress=False)
    a, b = load_all(out), load_all(ref)
    assert sorted(a) == sorted(b) == list(range(400))
    assert not any(formats.TMP_MARK in p.name for p in (out / "hidden_states").rglob("*"))
    for i in a:
        assert torch.equal(a[i].input_ids, b[i].input_ids)
        assert all(torch.equal(x, y) for x, y in zip(a[i].hidden_states, b[i].hidden_states))


def edit_prepared(prepared: Path, line: int, edit) -> None:
    """Change the sample on `line` (1-based) of prepared.jsonl in place."""
    import json

    path = prepared / formats.PREPARED_FILE
    records = [json.loads(x) for x in path.read_text().splitlines()]
    edit(records[line - 1])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("bad", [400, -1, 3.0])  # the tiny target's vocabulary holds ids 0..399
def test_token_id_outside_the_vocabulary_is_refused_before_anything_is_written(tiny_target, prepared, tmp_path, bad):
    edit_prepared(prepared, 2, lambda r: r["input_ids"].__setitem__(1, bad))
    with pytest.raises(
        ValueError,
        match=rf"^{prepared / formats.PREPARED_FILE}:2: sample chat1: token id {bad} "
        r"\(token 1\) is not in the target's vocabulary of 400 \(ids 0 to 399\)",
    ):
        extract(ExtractOptions(prepared=prepared, out=tmp_path / "data", target=str(tiny_target)), show_progress=False)
    assert not (tmp_path / "data").exists()


def test_samples_longer_than_the_target_positions_are_refused(tiny_target, prepared, tmp_path):
    """A prepared dataset from before prepare checked --max-length, or edited: 1030 tokens on a 1024-position target."""
    edit_prepared(
        prepared,
        3,
        lambda r: r.update(input_ids=(r["input_ids"] * 400)[:1030], loss_mask=(r["loss_mask"] * 400)[:1030]),
    )
    config = formats.read_json(prepared / formats.PREPARE_CONFIG_FILE)  # as prepared at --max-length 2048
    formats.write_json_atomic(prepared / formats.PREPARE_CONFIG_FILE, {**config, "max_length": 2048})
    with pytest.raises(
        ValueError,
        match=rf"^{prepared / formats.PREPARED_FILE}:3: sample chat2 has 1030 tokens, "
        rf"more than the 1024 positions the target holds \(max_position_embeddings "
        rf"in {tiny_target / 'config.json'}\); 1 of 12 samples are that long: run "
        r"`eaglet prepare` again with --max-length 1024 or less$",
    ):
        extract(ExtractOptions(prepared=prepared, out=tmp_path / "data", target=str(tiny_target)), show_progress=False)
    assert not (tmp_path / "data").exists()


def fail_first_batch(monkeypatch) -> None:
    import eaglet.extract

    def out_of_memory(*a, **k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(eaglet.extract, "run_batch", out_of_memory)


@pytest.mark.parametrize("layout", ["v1", "speculators"])
def test_a_run_that_wrote_no_sample_does_not_lock_the_folder(
    tiny_target, prepared, chats_jsonl, tmp_path, monkeypatch, layout
):
    """It leaves data_config.json and side files; a rerun on other data (the input fixed) replaces them."""
    out = tmp_path / "data"
    fail_first_batch(monkeypatch)
    with pytest.raises(RuntimeError, match="out of memory"):
        extract(ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), layout=layout), show_progress=False)
    assert (out / formats.DATA_CONFIG_FILE).exists() and not formats.list_dataset_files(out).files
    monkeypatch.undo()
    fixed = tmp_path / "fixed"
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=fixed, max_length=512, num_samples=5))
    summary = extract(ExtractOptions(prepared=fixed, out=out, target=str(tiny_target)), show_progress=False)
    samples, _ = formats.read_prepared(fixed)
    assert summary.written == 5 and formats.read_json(out / formats.DATA_CONFIG_FILE)["num_samples"] == 5
    lengths = formats.read_sample_lengths(out / formats.SAMPLE_LENGTHS_FILE)
    assert lengths == {i: len(s.input_ids) for i, s in enumerate(samples)}
    assert formats.list_dataset_files(out).format == formats.FORMAT_V1 and not (out / formats.ARROW_STATE_FILE).exists()
    # Now that the folder holds samples, another dataset is refused as before.
    with pytest.raises(ValueError, match="holds a dataset made with .*delete the folder to start over"):
        extract(ExtractOptions(prepared=prepared, out=out, target=str(tiny_target)), show_progress=False)


def test_a_resume_at_another_compute_dtype_is_refused(tiny_target, prepared, tmp_path):
    """Resumed with --dtype fp32 into a bf16-computed dataset, extract mixed the two roundings under
    a data_config.json that still said bfloat16."""
    out = tmp_path / "data"
    extract(
        ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), dtype="bf16", num_shards=2, shard_id=0),
        show_progress=False,
    )
    with pytest.raises(
        ValueError,
        match=r"holds a dataset made with compute_dtype='bfloat16', this run has "
        r"'float32'",
    ):
        extract(
            ExtractOptions(prepared=prepared, out=out, target=str(tiny_target), dtype="fp32", num_shards=2, shard_id=1),
            show_progress=False,
        )


def test_a_prepared_sample_beyond_its_recorded_max_length_is_refused(tiny_target, prepared, tmp_path):
    """prepare_config.json's max_length lowered below its samples: extract recorded the bound as the
    dataset's and check found it CLEAN."""
    folder = Path(shutil.copytree(prepared, tmp_path / "prepared"))
    config = formats.read_json(folder / formats.PREPARE_CONFIG_FILE)
    formats.write_json_atomic(folder / formats.PREPARE_CONFIG_FILE, {**config, "max_length": 8})
    with pytest.raises(
        ValueError,
        match=r"prepared\.jsonl:\d+: a sample of \d+ tokens, beyond prepare_config\.json's "
        r"max_length 8; the files were changed since prepare",
    ):
        extract(ExtractOptions(prepared=folder, out=tmp_path / "data", target=str(tiny_target)), show_progress=False)
    assert not (tmp_path / "data").exists()


def test_a_config_replaced_before_the_first_write_is_refused(tiny_target, prepared, tmp_path, monkeypatch):
    """Another run on other data may replace a config that has no sample file yet; this run then
    must not add its files to that run's dataset."""
    import eaglet.extract

    out = tmp_path / "data"
    real_run_batch = eaglet.extract.run_batch

    def other_run_replaces_the_config(*a, **k):
        config = formats.read_json(out / formats.DATA_CONFIG_FILE)
        formats.write_json_atomic(out / formats.DATA_CONFIG_FILE, {**config, "prepared_sha256": "another"})
        return real_run_batch(*a, **k)

    monkeypatch.setattr(eaglet.extract, "run_batch", other_run_replaces_the_config)
    with pytest.raises(ValueError, match="prepared_sha256='another'"):
        extract(ExtractOptions(prepared=prepared, out=out, target=str(tiny_target)), show_progress=False)
    assert not formats.list_dataset_files(out).files
