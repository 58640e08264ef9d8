"""The compact layout: 6-bit aux states (E3M2, fp16 scale per 32) and the target's top-K in place
of the last state. Quantization against its definition, the stored teacher against the one
training computes from the last state, extraction and conversion, check's findings, training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eaglet import check as C
from eaglet import formats
from eaglet.convert import convert
from eaglet.drafter import build_draft_vocab, make_teacher, target_top_k, teacher_from_top_k
from helpers import final_norm, write_foreign
from eaglet.options import CheckOptions, ConvertOptions, ExtractOptions, PrepareOptions, TrainOptions

LAYER_IDS = [2, 3, 4, 8]


# ---------------------------------------------------------------------------------------------
# Quantization and the stored teacher, against their definitions
# ---------------------------------------------------------------------------------------------


def test_fp6_values_are_e3m2():
    mags = formats.FP6_MAGNITUDES
    assert len(formats.FP6_VALUES) == 64 and mags[0] == 0 and formats.FP6_MAX == 28.0
    assert mags[1] == 2.0**-4 and mags[4] == 0.25 and mags[-4:].tolist() == [16, 20, 24, 28]
    assert (mags.diff() > 0).all()


def test_pack_6bit_is_a_bijection():
    codes = torch.randint(0, 64, (5, 3, 96), dtype=torch.uint8)
    packed = formats.pack_6bit(codes)
    assert packed.shape == (5, 3, 72) and torch.equal(formats.unpack_6bit(packed), codes)


def test_quantize_rounds_to_the_nearest_value_of_each_group():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 64) * torch.logspace(-3, 3, 4)[:, None, None]
    x[0, 0, :32] = 0  # an all-zero group
    codes, scales = formats.quantize_fp6(x)
    assert codes.shape == (4, 3, 48) and scales.shape == (4, 3, 2) and scales.dtype == torch.float16
    y = formats.dequantize_fp6(codes, scales)
    assert torch.equal(y[0, 0, :32], torch.zeros(32))
    # Brute force: for each value, the nearest of the 64 representable ones at its group's scale.
    s = scales.float().repeat_interleave(32, dim=-1)
    grid = formats.FP6_VALUES[None, None, None, :] * s[..., None]
    best = (grid - x[..., None]).abs().min(-1).values
    assert torch.allclose((y - x).abs(), best, rtol=0, atol=1e-6 * float(x.abs().max()))
    # Representable inputs come back exactly; the group's largest magnitude is kept to fp16 precision.
    exact = formats.FP6_VALUES[torch.randint(0, 64, (2, 64))] * 0.5
    exact[:, 0] = 28 * 0.5
    exact[:, 32] = -28 * 0.5
    assert torch.equal(formats.dequantize_fp6(*formats.quantize_fp6(exact)), exact)


def test_the_encoder_writes_no_impossible_group():
    """What `impossible_fp6_groups` calls impossible, quantize_fp6 never writes: over 12 decades of
    magnitude (subnormal and underflowing fp16 scales too), exact values, zero and one-value groups."""
    torch.manual_seed(2)
    x = torch.randn(40, 3, 256) * torch.logspace(-9, 3, 40)[:, None, None]
    x[0, 0] = 0
    x[1, 1, :32] = 0
    x[1, 1, 5] = -1e-3  # one value in a group of zeros
    x[2] = formats.FP6_VALUES[torch.randint(0, 64, (3, 256))] * 0.25
    codes, scales = formats.quantize_fp6(x)
    assert not formats.impossible_fp6_groups(codes, scales).any()
    assert (scales == 0).any() and ((scales > 0) & (scales < torch.finfo(torch.float16).tiny)).any()


def test_quantize_refuses_values_beyond_fp16_scales():
    with pytest.raises(ValueError, match="overflow the fp16 scale"):
        formats.quantize_fp6(torch.full((1, 32), 1e7))


@pytest.fixture(scope="module")
def head():
    torch.manual_seed(1)
    norm = torch.nn.LayerNorm(16, elementwise_affine=False)
    return norm, torch.nn.Linear(16, 50, bias=False)


def test_stored_teacher_equals_the_computed_one(head):
    """With K covering the vocabulary the stored teacher is the computed one; with a small K the
    argmax and whether it is drafted stay exact, and the kept ids match where the K held them."""
    norm, lm_head = head
    last = torch.randn(2, 9, 16)
    freq = {t: 100 - t for t in range(0, 50, 2)}  # even ids drafted
    d2t, t2d = build_draft_vocab(freq, 50, 25)
    for top_k in (1, 4):
        ref = make_teacher(last, norm, lm_head, d2t, t2d, top_k=top_k)
        ids, lp = target_top_k(last.reshape(-1, 16), norm, lm_head, 50)
        full = teacher_from_top_k(ids.reshape(2, 9, 50), lp.reshape(2, 9, 50), d2t, t2d, top_k)
        assert torch.equal(full.ids, ref.ids) and torch.equal(full.argmax, ref.argmax)
        assert torch.equal(full.in_draft, ref.in_draft)
        assert torch.allclose(full.log_probs, ref.log_probs, atol=2e-3)  # fp16 storage
        ids, lp = target_top_k(last.reshape(-1, 16), norm, lm_head, 3)
        small = teacher_from_top_k(ids.reshape(2, 9, 3), lp.reshape(2, 9, 3), d2t, t2d, top_k)
        assert torch.equal(small.in_draft, ref.in_draft)
        assert torch.equal(small.argmax[ref.in_draft], ref.argmax[ref.in_draft])
        assert torch.isfinite(small.log_probs.logsumexp(-1)).all()  # no row without a teacher


# ---------------------------------------------------------------------------------------------
# Extraction, conversion, check, training on the tiny target
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tiny_target, tmp_path_factory) -> Path:
    """The same prepared chats extracted as v1 (root/v1) and compact (root/cmp)."""
    from conftest import CHATS, write_jsonl

    from eaglet.prepare import prepare
    from eaglet.extract import extract

    root = tmp_path_factory.mktemp("compact")
    records = []
    for n in range(10):
        chat = [dict(m) for m in CHATS[n % len(CHATS)]]
        chat[-1]["content"] += " More words." * (n % 4)
        records.append({"id": f"c{n}", "messages": chat})
    prepare(
        PrepareOptions(
            target=str(tiny_target),
            data=str(write_jsonl(root / "chats.jsonl", records)),
            out=root / "prep",
            max_length=256,
        )
    )
    for name, layout in (("v1", "v1"), ("cmp", "compact")):
        extract(
            ExtractOptions(
                prepared=root / "prep",
                out=root / name,
                target=str(tiny_target),
                layer_ids=LAYER_IDS,
                dtype="fp32",
                layout=layout,
                stored_top_k=8,
            ),
            show_progress=False,
        )
    return root


def files(folder: Path) -> dict[int, Path]:
    return dict(formats.list_dataset_files(folder).files)


def test_extract_compact_holds_v1s_states_and_teacher(made, tiny_target):
    v1, cmp = files(made / "v1"), files(made / "cmp")
    assert sorted(v1) == sorted(cmp) == list(range(10))
    assert all(p.parent.parent.name == formats.COMPACT_DIR for p in cmp.values())
    from transformers import AutoModelForCausalLM

    from eaglet.drafter import make_teacher_head

    head = make_teacher_head(AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32), "pre_norm")
    for i in range(10):
        a = formats.read_v1_sample(v1[i])
        obj = formats.read_safetensors(cmp[i])
        assert torch.equal(obj["input_ids"].long(), a.input_ids) and torch.equal(obj["loss_mask"].long(), a.loss_mask)
        codes, scales = formats.quantize_fp6(torch.stack(a.hidden_states[:3], dim=1))
        assert torch.equal(obj["aux_codes"], codes) and torch.equal(obj["aux_scales"], scales)
        ids, lp = target_top_k(a.hidden_states[3].float(), head.final_norm, head.lm_head, 8)
        assert torch.equal(obj["teacher_ids"], ids) and torch.equal(obj["teacher_log_probs"], lp)
    cfg = json.loads((made / "cmp" / formats.DATA_CONFIG_FILE).read_text())
    assert cfg["format"] == formats.FORMAT_COMPACT and cfg["compact"]["teacher_top_k"] == 8
    report = C.check_dataset(CheckOptions(path=made / "cmp", target=str(tiny_target)))
    assert report.clean and report.format == formats.FORMAT_COMPACT, report.lines()
    assert [s.best for s in report.identity] == [f"layer {k}" for k in LAYER_IDS[:3]]
    assert report.next_token_accuracy["agreement"] == 1.0


def test_compact_extraction_resumes(made, tiny_target, tmp_path):
    from eaglet.extract import extract

    ds = Path(shutil.copytree(made / "cmp", tmp_path / "cmp"))
    victim = files(ds)[3]
    victim.write_bytes(victim.read_bytes()[:200])
    summary = extract(
        ExtractOptions(
            prepared=made / "prep",
            out=ds,
            target=str(tiny_target),
            layer_ids=LAYER_IDS,
            dtype="fp32",
            layout="compact",
            stored_top_k=8,
        ),
        show_progress=False,
    )
    assert summary.written == 1 and summary.already_done == 9
    assert files(ds)[3].read_bytes() == files(made / "cmp")[3].read_bytes()
    with pytest.raises(ValueError, match="compact"):  # another K is another dataset
        extract(
            ExtractOptions(
                prepared=made / "prep",
                out=ds,
                target=str(tiny_target),
                layer_ids=LAYER_IDS,
                dtype="fp32",
                layout="compact",
                stored_top_k=4,
            ),
            show_progress=False,
        )


def test_convert_to_compact_equals_extraction(made, tmp_path):
    convert(
        ConvertOptions(src=made / "v1", out=tmp_path / "cmp", layout="compact", stored_top_k=8), show_progress=False
    )
    for i, p in files(made / "cmp").items():
        a, b = formats.read_compact_file(p), formats.read_compact_file(files(tmp_path / "cmp")[i])
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in formats.COMPACT_KEYS), i
        assert a.metadata == b.metadata and formats.compact_checksum_problems(b) == [], i  # both writers checksum
    with pytest.raises(ValueError, match="no other layout can be made from it"):
        convert(ConvertOptions(src=made / "cmp", out=tmp_path / "v1", layout="v1"), show_progress=False)


@pytest.mark.parametrize(
    "layout",
    [formats.FORMAT_V1_FLAT, formats.FORMAT_SPECFORGE, formats.FORMAT_HS_SAFETENSORS, formats.FORMAT_SPECULATORS_ARROW],
)
def test_every_layout_converts_to_compact_and_trains(made, tiny_target, tmp_path, layout):

    from eaglet.training.loop import train

    foreign = write_foreign(made / "v1", tmp_path / "foreign", layout, final_norm(tiny_target))
    convert(
        ConvertOptions(
            src=foreign,
            out=tmp_path / "cmp",
            layout="compact",
            target=str(tiny_target),
            aux_layer_ids=LAYER_IDS[:3],
            stored_top_k=8,
        ),
        show_progress=False,
    )
    report = C.check_dataset(CheckOptions(path=tmp_path / "cmp", target=str(tiny_target)))
    assert report.clean, report.lines()
    # The teacher's argmax is the one v1's last state gives: the same bits from a pre-norm state;
    # from SpecForge's post-norm one (normed, then rounded to bf16) near-ties of this random model may flip.
    agree = total = 0
    for i, p in files(tmp_path / "cmp").items():
        ref = formats.read_safetensors(files(made / "cmp")[i])["teacher_ids"][:, 0]
        got = formats.read_safetensors(p)["teacher_ids"][:, 0]
        assert layout == formats.FORMAT_SPECFORGE or torch.equal(got, ref), i
        agree, total = agree + int((got == ref).sum()), total + len(ref)
    assert agree / total > 0.95
    summary = train(
        TrainOptions(
            dataset_dir=tmp_path / "cmp",
            out_dir=tmp_path / "run",
            total_steps=2,
            teacher_top_k=8,
            eval_fraction=0.2,
            batch_size=3,
        ),
        show_progress=False,
    )  # padded rows of stored teachers too
    assert summary.step == 2


def test_heldout_accuracy_is_the_same_on_compact_and_v1(made, tmp_path):
    """Held-out acceptance needs only the teacher's argmax and whether it is drafted, which the
    stored top-K holds exactly: a drafter scores the same on v1 and on its compact copy."""
    from eaglet.training.heldout import evaluate_heldout
    from eaglet.training.loop import train

    # fp32 on every machine: under bf16 autocast the 6-bit aux states' rounding can tip an argmax
    train(
        TrainOptions(
            dataset_dir=made / "v1",
            out_dir=tmp_path / "run",
            total_steps=3,
            eval_fraction=0.3,
            batch_size=2,
            bf16=False,
        ),
        show_progress=False,
    )
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    v1, cmp = (
        evaluate_heldout(ckpt, made / name, eval_fraction=0.3, batch_size=2, bf16=False) for name in ("v1", "cmp")
    )
    assert v1["acc"] == cmp["acc"] and v1["positions"] == cmp["positions"]


def test_train_on_compact_refuses_what_needs_the_last_state(made, tmp_path):
    from eaglet.training.loop import train

    for options, message in (
        ({"teacher_top_k": 0}, "stores the target's top 8 only"),
        ({"teacher_top_k": 9}, "stores the target's top 8 only"),
        ({"teacher_top_k": 8, "feature_loss_weight": 0.1}, "no last-layer state"),
    ):
        with pytest.raises(ValueError, match=message):
            train(
                TrainOptions(dataset_dir=made / "cmp", out_dir=tmp_path / "run", total_steps=1, **options),
                show_progress=False,
            )


@pytest.fixture
def cmp_copy(made, tmp_path) -> Path:
    return Path(shutil.copytree(made / "cmp", tmp_path / "cmp"))


def edit(ds: Path, i: int, **changes: torch.Tensor) -> str:
    """File i rewritten with `changes` (None drops a tensor) and checksums that match them: a fault
    the writer made, which only the checks of the content can find."""
    from safetensors.torch import save_file

    path = files(ds)[i]
    obj = formats.read_safetensors(path)
    obj.update(changes)
    tensors = {k: v.contiguous() for k, v in obj.items() if v is not None}
    save_file(tensors, str(path), metadata=formats.compact_checksums(tensors))
    return str(path.relative_to(ds))


def test_check_finds_planted_faults_in_compact_files(cmp_copy, tiny_target):
    ds = cmp_copy
    obj = {i: formats.read_safetensors(p) for i, p in files(ds).items()}
    planted = {
        C.STORED_TEACHER: [
            edit(ds, 0, teacher_ids=obj[0]["teacher_ids"] + 1000),
            edit(ds, 1, teacher_log_probs=obj[1]["teacher_log_probs"].flip(-1)),
            edit(ds, 2, teacher_log_probs=torch.full_like(obj[2]["teacher_log_probs"], float("nan"))),
        ],
        C.WRONG_DTYPE: [edit(ds, 3, aux_scales=obj[3]["aux_scales"].float())],
        C.WRONG_SHAPE: [edit(ds, 4, aux_codes=obj[4]["aux_codes"][:, :2].contiguous())],
        C.MASK_VALUES: [edit(ds, 5, loss_mask=obj[5]["loss_mask"] * 2)],
        C.WRONG_KEYS: [edit(ds, 6, teacher_ids=None)],
        C.NON_FINITE: [edit(ds, 9, aux_scales=obj[9]["aux_scales"].index_fill(0, torch.tensor([2]), float("nan")))],
    }
    # File 1 again: its teacher reversed (above) and cut to another K.
    planted[C.WRONG_SHAPE].append(
        edit(
            ds,
            1,
            teacher_ids=obj[1]["teacher_ids"][:, :4].contiguous(),
            teacher_log_probs=obj[1]["teacher_log_probs"].flip(-1)[:, :4].contiguous(),
        )
    )
    trunc = files(ds)[7]
    trunc.write_bytes(trunc.read_bytes()[:100])
    planted[C.UNREADABLE] = [str(trunc.relative_to(ds))]
    files(ds)[8].unlink()
    planted[C.MISSING_INDEX] = [""]
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    found = {(p.kind, p.path) for p in report.problems}
    for kind, paths in planted.items():
        for path in paths:
            assert (kind, path) in found, (kind, path, report.lines())


def test_check_names_a_compact_file_of_another_layer_or_model(cmp_copy, tiny_target):
    ds = cmp_copy
    obj = formats.read_safetensors(files(ds)[2])
    swapped = obj["aux_codes"][:, [1, 0, 2]].contiguous(), obj["aux_scales"][:, [1, 0, 2]].contiguous()
    rel = edit(ds, 2, aux_codes=swapped[0], aux_scales=swapped[1])
    lp = formats.read_safetensors(files(ds)[5])["teacher_log_probs"].float()
    edit(ds, 5, teacher_log_probs=(lp - 0.5).half())  # a teacher from another model
    report = C.check_dataset(CheckOptions(path=ds, target=str(tiny_target), identity_samples=10))
    assert any(p.kind == C.LAYER_IDENTITY and p.path == rel and "slot 0" in p.message for p in report.problems), (
        report.lines()
    )
    assert any(p.kind == C.STORED_TEACHER and "recomputed target's by 0.5" in p.message for p in report.problems), (
        "\n".join(report.lines())
    )


def tensor_bytes(path: Path, name: str) -> tuple[int, int]:
    """[start, end) of a tensor's bytes in a safetensors file (8-byte header length, JSON header, data)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def overwrite(ds: Path, i: int, name: str, offset: int, data: bytes) -> str:
    """Bytes of tensor `name` in file i changed in place, as a disk or a copy damages a file."""
    path = files(ds)[i]
    start, end = tensor_bytes(path, name)
    assert start + offset + len(data) <= end
    raw = bytearray(path.read_bytes())
    raw[start + offset : start + offset + len(data)] = data
    path.write_bytes(bytes(raw))
    return str(path.relative_to(ds))


def flip_bit(ds: Path, i: int, name: str, offset: int, bit: int) -> str:
    path = files(ds)[i]
    start, _ = tensor_bytes(path, name)
    return overwrite(ds, i, name, offset, bytes([path.read_bytes()[start + offset] ^ (1 << bit)]))


def checksum_findings(ds: Path) -> list[tuple[str, str]]:
    """(file, what: the tensor named) of each checksum finding of `eaglet check` without the target."""
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert not report.clean
    return [(p.path, p.message.split(";")[0].split(":")[0]) for p in report.problems if p.kind == C.CHECKSUM]


def code_byte(codes: torch.Tensor, t: int, s: int, j: int) -> tuple[int, int]:
    """(byte offset in aux_codes, bit) of bit 0 of code j of row t, state s: four codes in three bytes."""
    row = (t * codes.shape[1] + s) * codes.shape[2]
    return row + (j // 4) * 3 + 6 * (j % 4) // 8, 6 * (j % 4) % 8


def test_a_clean_compact_dataset_is_clean_without_the_target(made):
    report = C.check_dataset(CheckOptions(path=made / "cmp", use_target=False))
    assert report.clean and not [p for p in report.problems if p.kind in (C.CHECKSUM, C.AUX_CODES)], report.lines()


def test_check_and_training_find_a_flipped_bit_in_the_aux_codes(cmp_copy):
    """A flipped low bit of a code that is not its group's largest: a well-formed file, which every
    other check passes (shown with matching checksums); the checksum names it, without the target,
    and training's reader refuses it."""
    ds = cmp_copy
    codes = formats.read_safetensors(files(ds)[4])["aux_codes"]
    j = int(((formats.unpack_6bit(codes[5, 1]) & 31) < 30).nonzero()[0])
    offset, bit = code_byte(codes, 5, 1, j)
    rel = flip_bit(ds, 4, "aux_codes", offset, bit)
    assert checksum_findings(ds) == [(rel, "aux_codes")]
    with pytest.raises(ValueError, match=f"{rel}: aux_codes: its bytes do not match.*delete the file and re-run"):
        formats.read_training_sample(ds / rel, formats.FORMAT_COMPACT)
    edit(ds, 4)  # the same bytes with checksums that match them
    assert C.check_dataset(CheckOptions(path=ds, use_target=False)).clean


def test_check_finds_a_row_of_0xff_in_the_aux_codes(cmp_copy):
    """0xFF bytes are codes 63 (-28 x the scale): valid codes the packing cannot tell from data, so
    the checksum is what finds them."""
    ds = cmp_copy
    codes = formats.read_safetensors(files(ds)[2])["aux_codes"]
    rel = overwrite(ds, 2, "aux_codes", code_byte(codes, 3, 0, 0)[0], b"\xff" * codes.shape[2])
    assert checksum_findings(ds) == [(rel, "aux_codes")]


@pytest.mark.parametrize(
    "name, bit", [("teacher_ids", 0), ("teacher_log_probs", 0), ("aux_scales", 3), ("input_ids", 1)]
)
def test_check_finds_a_flipped_bit_in_any_tensor(cmp_copy, name, bit):
    ds = cmp_copy
    rel = flip_bit(ds, 6, name, 10, bit)
    assert checksum_findings(ds) == [(rel, name)]
    with pytest.raises(ValueError, match=f"{rel}: {name}: its bytes do not match"):
        formats.read_training_sample(ds / rel, formats.FORMAT_COMPACT)


def test_check_names_impossible_aux_codes_by_row(cmp_copy):
    """Codes no encoder output has, in files whose checksums match (a faulty writer, or a version-1
    file): a group whose largest code is not E3M2's largest, a negative scale."""
    ds = cmp_copy
    obj = {i: formats.read_safetensors(files(ds)[i]) for i in (1, 3)}
    codes = obj[1]["aux_codes"].clone()
    codes[7, 2] = 0
    zeroed = edit(ds, 1, aux_codes=codes)
    scales = obj[3]["aux_scales"].clone()
    scales[4, 1, 1] = -scales[4, 1, 1]
    negative = edit(ds, 3, aux_scales=scales)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    found = {p.path: p.message for p in report.problems if p.kind == C.AUX_CODES}
    assert sorted(found) == sorted([zeroed, negative]) and not [p for p in report.problems if p.kind == C.CHECKSUM]
    assert found[zeroed].startswith("aux row 7, state 2, values 0..31") and "rows 7);" in found[zeroed]
    assert found[negative].startswith("aux row 4, state 1, values 32..63: a negative scale")


def strip_checksums(ds: Path, version: int) -> None:
    """The dataset as an eaglet before checksums wrote it: no header metadata, data_config.json's version."""
    from safetensors.torch import save_file

    for path in files(ds).values():
        save_file(formats.read_safetensors(path), str(path))
    cfg = json.loads((ds / formats.DATA_CONFIG_FILE).read_text())
    cfg["compact"]["version"] = version
    (ds / formats.DATA_CONFIG_FILE).write_text(json.dumps(cfg))


def test_version_1_compact_data_is_read_with_a_warning(made, cmp_copy, caplog):
    """Written before checksums: checked (impossible codes still found) and trained on, with a warning
    on data_config.json that says what cannot be found and what writes files that can be checked."""
    ds = cmp_copy
    strip_checksums(ds, 1)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert report.clean, report.lines()
    [w] = [p for p in report.problems if p.kind == C.DATA_CONFIG]
    assert w.severity == C.WARNING and "compact version 1" in w.message
    assert "eaglet convert --layout compact" in w.message
    with caplog.at_level("WARNING", logger="eaglet.formats"):
        for path in files(ds).values():
            formats.read_training_sample(path, formats.FORMAT_COMPACT)
    assert [r.getMessage() for r in caplog.records if "compact version 1" in r.getMessage()] == [
        f"{ds}: {formats.compact_version_warning({'compact': {'version': 1}})}"
    ]  # once per dataset
    codes = formats.read_safetensors(files(ds)[0])["aux_codes"].clone()
    codes[1] = 0
    rel = edit(ds, 0, aux_codes=codes)
    strip_checksums(ds, 1)
    report = C.check_dataset(CheckOptions(path=ds, use_target=False))
    assert [p.path for p in report.problems if p.kind == C.AUX_CODES] == [rel]
    with pytest.raises(ValueError, match="made with compact=.*'version': 1.*use another --out"):  # never mixed
        convert(ConvertOptions(src=made / "v1", out=ds, layout="compact", stored_top_k=8), show_progress=False)


def test_current_compact_data_needs_its_checksums(cmp_copy):
    """In a version-2 dataset a file without checksums (another tool's, or rewritten) is named; an
    unknown version is refused with what to do."""
    from safetensors.torch import save_file

    ds = cmp_copy
    path = files(ds)[8]
    save_file(formats.read_safetensors(path), str(path))
    rel = str(path.relative_to(ds))
    assert checksum_findings(ds) == [
        (
            rel,
            "no sha256 checksums in its header (written before compact version 2, by another tool, or rewritten since)",
        )
    ]
    with pytest.raises(ValueError, match=f"{rel}: no sha256 checksums"):
        formats.read_training_sample(path, formats.FORMAT_COMPACT)
    problem = formats.compact_version_problem({"compact": {"version": 3}})
    assert "reads versions 1, 2" in problem and "eaglet convert --layout compact" in problem
