"""Each written file's per-slot signature (formats.signatures): the same however it is computed,
another layer's or shifted rows far from it, the log whole whatever moment a writer is killed at,
a file redone matching its newest record, a line of another scheme not compared."""

from __future__ import annotations

import json
import os
import math

import torch

from eaglet import formats
from eaglet.formats import signatures


def states(seed: int, rows: int = 3000, width: int = 96) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=g) * (k + 1)).to(torch.bfloat16) for k in range(4)]


def flat(signature: formats.Signature) -> formats.Recorded:
    return formats.Recorded(signatures.array("d", (v for slot in signature for v in slot)), "")


def test_a_signature_is_the_same_however_it_is_computed_and_tells_whole_slot_changes(monkeypatch):
    """Chunking and threads change float32 rounding only: far inside the tolerance. A slot swapped,
    rows shifted by one, or another file's states are far outside it."""
    h = states(0)
    recorded = formats.state_signature(h)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(signatures, "CHUNK_VALUES", 7 * 96)
        again = formats.state_signature(h)
    finally:
        torch.set_num_threads(threads)
    assert max(signatures.slot_distance(a, b) for a, b in zip(again, recorded)) < formats.SIGNATURE_TOLERANCE / 100
    shifted = [h[0], h[1].roll(1, 0), h[3], h[2]]
    found = formats.signature_mismatches(formats.state_signature(shifted), [flat(recorded)])
    assert [(m.slot, m.holds) for m in found] == [(1, None), (2, 3), (3, 2)]
    assert min(m.distance for m in found) > 100 * formats.SIGNATURE_TOLERANCE
    other = formats.state_signature(states(1))
    assert len(formats.signature_mismatches(other, [flat(recorded)])) == 4


def test_an_empty_or_non_finite_slot_is_left_to_the_value_checks():
    h = states(0, rows=16)
    recorded = flat(formats.state_signature(h))
    h[2][3, 5] = math.nan  # the value checks name it; the signature does not blame extraction for it
    assert formats.signature_mismatches(formats.state_signature(h), [recorded]) == []
    empty = [x[:0] for x in h]
    assert formats.signature_mismatches(formats.state_signature(empty), [flat(formats.state_signature(empty))]) == []


def test_the_log_stays_readable_after_a_kill_mid_append_and_a_redone_file_matches(tmp_path):
    log = formats.SignatureLog(tmp_path, "shard_0_of_2", "k0")
    assert not (tmp_path / formats.SIGNATURES_DIR).exists()  # made at its first line, not before
    log.record(0, formats.state_signature(states(0, rows=10)), "0123456789abcdef")
    with open(log.path, "a") as f:  # a run killed mid-append: its file was never renamed into place
        f.write('{"v": 2, "of": "k0", "index": 2, "tokens": "t2", "slots": [[1.0, ')
    assert sorted(formats.read_signatures(tmp_path)[0] or {}) == [0]
    again = formats.SignatureLog(tmp_path, "shard_0_of_2", "k0")
    redone = formats.state_signature(states(1, rows=10))
    again.record(0, redone, "0123456789abcdef")
    recorded, problems = formats.read_signatures(tmp_path, "k0")
    assert problems == [] and sorted(recorded or {}) == [0] and len((recorded or {})[0]) == 2
    assert formats.signature_mismatches(redone, (recorded or {})[0]) == []
    assert formats.read_signatures(tmp_path / "elsewhere") == (None, [])
    (tmp_path / formats.SIGNATURES_DIR / "odd.jsonl").mkdir()
    assert formats.read_signatures(tmp_path)[1][0][0] == f"{formats.SIGNATURES_DIR}/odd.jsonl"


def test_lines_that_vouch_for_nothing_are_named_per_log_and_not_kept(tmp_path):
    """Another extraction's lines copied in, lines of another scheme, a line of no slots or an
    odd digest, a line far longer than any of ours, and a pipe named like a log: each named,
    none kept, and no read blocks or takes the whole line into memory."""
    sig = formats.state_signature(states(0, rows=10))
    formats.SignatureLog(tmp_path, "shard_0_of_1", "ours").record(0, sig, "0123456789abcdef")
    formats.SignatureLog(tmp_path, "shard_0_of_9", "theirs").record(1, sig, "0123456789abcdef")
    folder = tmp_path / formats.SIGNATURES_DIR
    with open(folder / "shard_0_of_1.jsonl", "a") as f:
        f.write(json.dumps({"v": 3, "of": "ours", "index": 2, "tokens": "0123456789abcdef", "slots": sig}) + "\n")
        f.write(json.dumps({"v": 2, "of": "ours", "index": 3, "tokens": "x", "slots": sig}) + "\n")
        f.write(json.dumps({"v": 2, "of": "ours", "index": 4, "tokens": "0123456789abcdef", "slots": []}) + "\n")
        f.write(json.dumps({"v": 2, "of": "ours", "index": 5, "pad": "x" * (1 << 20), "slots": sig}) + "\n")
        f.write(json.dumps({"v": 2, "of": "ours", "index": 6, "tokens": "0123456789abcdef", "slots": sig}) + "\n")
    os.mkfifo(folder / "zz.jsonl")
    recorded, problems = formats.read_signatures(tmp_path, "ours")
    assert sorted(recorded or {}) == [0, 6]  # the line after the long one is read as its own
    said = dict(problems)
    assert "scheme v=3" in said[f"{formats.SIGNATURES_DIR}/shard_0_of_1.jsonl"]
    assert "another extraction" in said[f"{formats.SIGNATURES_DIR}/shard_0_of_9.jsonl"]
    assert "a pipe or device" in said[f"{formats.SIGNATURES_DIR}/zz.jsonl"]
    for n in (3, 4):
        assert (
            "a tokens digest and an extraction key expected" in said[f"{formats.SIGNATURES_DIR}/shard_0_of_1.jsonl:{n}"]
        )
    assert "longer than" in said[f"{formats.SIGNATURES_DIR}/shard_0_of_1.jsonl:5"]
    assert sorted(formats.read_signatures(tmp_path)[0] or {}) == [0, 1, 6]  # no dataset key: any extraction's
