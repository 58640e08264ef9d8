"""Each written file's per-slot signature (formats.signatures): the same however it is computed,
the log whole whatever moment a writer is killed at, a file redone matching its newest record."""

from __future__ import annotations

import torch

from eaglet import formats
from eaglet.formats import signatures


def states(seed: int, rows: int = 3000, width: int = 96) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=g) * (k + 1)).to(torch.bfloat16) for k in range(4)]


def test_a_signature_is_the_same_however_it_is_computed(monkeypatch):
    """Chunking and threads change float32 rounding only: far inside the tolerance, while the
    smallest real change (one row of one slot) is far outside it."""
    h = states(0)
    recorded = formats.state_signature(h)
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(signatures, "CHUNK_VALUES", 7 * 96)
        again = formats.state_signature(h)
    finally:
        torch.set_num_threads(2)
    assert max(signatures.slot_distance(a, b) for a, b in zip(again, recorded)) < formats.SIGNATURE_TOLERANCE / 100
    changed = [x.clone() for x in h]
    changed[2][100] = changed[2][101]
    assert [m.slot for m in formats.signature_mismatches(formats.state_signature(changed), [recorded])] == [2]


def test_the_log_stays_readable_after_a_kill_mid_append_and_a_redone_file_matches(tmp_path):
    log = formats.SignatureLog(tmp_path, 0, 2)
    log.record(0, formats.state_signature(states(0, rows=10)))
    with open(log.path, "a") as f:  # a run killed mid-append: its file was never renamed into place
        f.write('{"index": 2, "slots": [[1.0, ')
    again = formats.SignatureLog(tmp_path, 0, 2)
    redone = formats.state_signature(states(1, rows=10))
    again.record(0, redone)
    recorded, problems = formats.read_signatures(tmp_path)
    assert problems == [] and sorted(recorded) == [0] and len(recorded[0]) == 2
    assert formats.signature_mismatches(redone, recorded[0]) == []
    assert formats.read_signatures(tmp_path / "elsewhere") == (None, [])
