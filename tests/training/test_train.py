"""`eaglet train` on a tiny target: dataset/target checks, metrics and checkpoints, exact
resume, and 2-process torchrun (gloo) matching one process with the same global batch."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglet import formats
from eaglet.cli import main as cli_main
from eaglet.drafter.files import load_checkpoint
from eaglet.training.checkpoints import iter_metrics
from eaglet.training.config import lr_lambda
from eaglet.dataset import open_dataset
from eaglet.training.data import BatchStream, bucketed_batches, pack, read_samples, split_indices
from eaglet.training import loop
from eaglet.training.loop import train
from helpers import FAST, run_weights
from eaglet.options import TrainOptions


def test_split_and_batches_are_deterministic():
    idx = list(range(40))
    lengths = {i: (i * 7) % 23 + 1 for i in idx}
    tr, ev = split_indices(idx, 0.1, seed=3)
    assert len(ev) == 4 and sorted(tr + ev) == idx and split_indices(idx, 0.1, 3) == (tr, ev)
    s1, s2 = BatchStream(tr, lengths, 4, 0), BatchStream(tr, lengths, 4, 0)
    assert [s1[m] for m in range(25)] == [s2[m] for m in range(25)]
    assert sorted(i for b in s1.epoch(1) for i in b) == tr and s1.epoch(0) != s1.epoch(1)
    assert len(bucketed_batches(tr, lengths, 4, None)) == s1.per_epoch == 9
    f = lr_lambda(warmup=2, total=10, min_ratio=0.0)
    assert f(0) == 0.5 and f(1) == 1.0 and f(2) == 1.0 and f(10) == pytest.approx(0.0)


def test_train_writes_metrics_and_checkpoints(dataset, tmp_path, monkeypatch):
    run = tmp_path / "run"
    summary = train(TrainOptions(dataset_dir=dataset, out_dir=run, total_steps=8, **FAST), show_progress=False)
    assert summary.step == 8 and summary.best_step is not None
    records = list(iter_metrics(run))
    train_rec = [r for r in records if r["split"] == "train"]
    eval_rec = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train_rec] == [2, 4, 6, 8] and [r["step"] for r in eval_rec] == [4, 8]
    for r in records:
        assert len(r["loss"]) == len(r["acc"]) == 3 and r["tau"] >= 0
    assert train_rec[-1]["loss"][0] < train_rec[0]["loss"][0]  # it learns
    ckpt = run / "checkpoints"
    best = formats.read_json(ckpt / "best.json")
    assert best["step"] == summary.best_step and (ckpt / best["path"] / "model.safetensors").exists()
    assert formats.read_json(ckpt / "latest.json")["path"] == "step_00000008"
    cfg = formats.read_json(ckpt / "step_00000008" / "config.json")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 400
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # hidden_states ids (vLLM)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds 1
    w = run_weights(run, 8)
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "d2t", "t2d", "lm_head.weight"} <= set(w)
    assert w["t2d"].dtype == torch.bool and w["d2t"].dtype == torch.int64
    assert not any(p.name.startswith(".") for p in ckpt.iterdir())  # no temp folders left
    draft = load_checkpoint(ckpt / "step_00000008")
    assert draft.config.aux_layer_ids == [2, 4, 5] and torch.equal(draft.fc.weight, w["fc.weight"])
    # a run already there is refused before the data (and so the target) is read
    monkeypatch.setattr(loop, "open_training_data", lambda *a: pytest.fail("read the data before refusing"))
    with pytest.raises(ValueError, match=r"already holds a training run \(checkpoint step_00000008\); pass --resume"):
        train(TrainOptions(dataset_dir=dataset, out_dir=run, total_steps=8, **FAST), show_progress=False)


def test_resume_continues_exactly(dataset, tmp_path, capsys):
    """`train --out R --resume` alone takes the run's settings; a kill's half-written checkpoint is removed."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(TrainOptions(dataset_dir=dataset, out_dir=straight, total_steps=8, **FAST), show_progress=False)
    first = train(
        TrainOptions(dataset_dir=dataset, out_dir=resumed, total_steps=8, stop_after=4, **FAST), show_progress=False
    )
    assert first.step == 4
    half_written = resumed / "checkpoints" / f".step_00000006{formats.TMP_MARK}k1ll3d"
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"cut")
    assert cli_main(["train", str(dataset), "--out", str(resumed), "--resume", "--log-every", "2"]) == 0
    a, b = run_weights(straight, 8), run_weights(resumed, 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in iter_metrics(resumed)] == [r["step"] for r in iter_metrics(straight)]
    assert not half_written.exists()
    capsys.readouterr()
    assert cli_main(["train", str(dataset), "--out", str(resumed), "--resume", "--lr", "1e-3"]) == 2
    assert "'lr': (0.003, 0.001)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lr"):
        train(
            TrainOptions(dataset_dir=dataset, out_dir=resumed, total_steps=8, resume=True, **{**FAST, "lr": 1e-3}),
            show_progress=False,
        )


def test_refuses_bad_dataset_and_other_target(dataset, tiny_target, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="data_config.json"):
        train(TrainOptions(dataset_dir=tmp_path / "empty", out_dir=tmp_path / "r"), show_progress=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in dataset.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    os.symlink(dataset / formats.HIDDEN_STATES_DIR, bad / formats.HIDDEN_STATES_DIR)
    os.symlink(dataset / formats.SIGNATURES_DIR, bad / formats.SIGNATURES_DIR)
    cfg = formats.read_json(dataset / formats.DATA_CONFIG_FILE)
    for change, msg in (
        ({"num_hidden_layers": 9}, "num_hidden_layers"),
        ({"num_samples": 99}, "99"),
        ({"last_hidden_state": "after_norm"}, "pre_norm"),
        ({"hidden_size": 32}, "hidden_states shapes"),
    ):
        formats.write_json_atomic(bad / formats.DATA_CONFIG_FILE, {**cfg, **change})
        with pytest.raises(ValueError, match=msg):
            open_dataset(bad)
    formats.write_json_atomic(bad / formats.DATA_CONFIG_FILE, {**cfg, "target_revision": "0123"})
    with pytest.raises(ValueError, match="target_revision"):
        train(TrainOptions(dataset_dir=bad, out_dir=tmp_path / "r", target=str(tiny_target)), show_progress=False)


def test_dataset_the_check_rejects_is_refused_with_its_message(dataset, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    path = formats.list_v1_files(bad)[1]
    sample = formats.read_v1_sample(path)
    sample.loss_mask = torch.cat([sample.loss_mask, sample.loss_mask])  # 2T mask beside T tokens
    formats.torch_save_atomic(sample.to_dict(), path)
    with pytest.raises(ValueError, match=r"eaglet check. rejects this dataset(.|\n)*data_1.pt"):
        train(TrainOptions(dataset_dir=bad, out_dir=tmp_path / "r"), show_progress=False)


def test_cli_train(dataset, tmp_path, capsys):
    rc = cli_main(
        [
            "train",
            str(dataset),
            "--out",
            str(tmp_path / "run"),
            "--total-steps",
            "2",
            "--ttt-steps",
            "2",
            "--eval-every",
            "2",
            "--log-every",
            "1",
            "--bf16",
        ]
    )
    assert rc == 0 and "best checkpoint: step 2" in capsys.readouterr().out
    assert cli_main(["train", str(tmp_path / "nothing"), "--out", str(tmp_path / "r2")]) == 2


def test_torchrun_two_processes_match_one(dataset, tmp_path):
    """2 processes x accumulation 1 == 1 process x accumulation 2 (same global batch, same order)."""
    opts = [
        "--total-steps",
        "4",
        "--ttt-steps",
        "2",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "1",
        "--batch-size",
        "2",
        "--eval-every",
        "2",
        "--log-every",
        "1",
        "--eval-fraction",
        "0.1",
    ]
    torchrun = Path(sys.executable).with_name("torchrun")
    with socket.socket() as sock:  # a free port, so parallel test runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run(
        [
            str(torchrun),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "eaglet.cli",
            "train",
            str(dataset),
            "--out",
            str(tmp_path / "two"),
            "--device",
            "cpu",
            *opts,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = train(
        TrainOptions(
            dataset_dir=dataset,
            out_dir=tmp_path / "one",
            device="cpu",
            grad_accum=2,
            total_steps=4,
            ttt_steps=2,
            lr=3e-3,
            warmup_steps=1,
            batch_size=2,
            eval_every=2,
            log_every=1,
            eval_fraction=0.1,
        ),
        show_progress=False,
    )
    assert one.step == 4
    a, b = run_weights(tmp_path / "one", 4), run_weights(tmp_path / "two", 4)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
    m_one = [r for r in iter_metrics(tmp_path / "one")]
    m_two = [r for r in iter_metrics(tmp_path / "two")]
    assert [r["step"] for r in m_one] == [r["step"] for r in m_two]
    assert m_one[-1]["positions"] == m_two[-1]["positions"]  # every rank's positions were counted
    assert json.loads((tmp_path / "two" / "train_config.json").read_text())["world_size"] == 2


def test_teacher_is_the_targets_own_next_token_distribution(dataset, tiny_target):
    """lm_head(final_norm(stored pre-norm state)) equals the target's logits, restricted to the draft vocab."""
    from transformers import AutoModelForCausalLM

    from eaglet.drafter import build_draft_vocab, make_teacher
    from eaglet.target import heads_of_model

    ds = open_dataset(dataset)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    head = heads_of_model(model)
    d2t, t2d = build_draft_vocab(ds.token_freq, 400, 100)
    sample = formats.read_v1_sample(ds.files[3])
    teacher = make_teacher(sample.hidden_states[-1][None], head.final_norm, head.lm_head, d2t, t2d)
    with torch.no_grad():
        logits = model(sample.input_ids[None]).logits.float()
    ref = torch.log_softmax(logits[..., torch.arange(100) + d2t], -1)
    torch.testing.assert_close(teacher.log_probs, ref, rtol=0, atol=0.05)  # stored states are bf16
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05  # bf16 states may flip near-ties
    assert clear.sum() >= 5
    assert torch.equal(teacher.in_draft[clear], t2d[logits.argmax(-1)][clear])


@pytest.mark.parametrize("field,value", [("hidden_size", 32), ("vocab_size", 401)])
def test_target_shape_mismatch_is_refused(field, value):
    from types import SimpleNamespace

    from eaglet.dataset import check_target_matches
    from eaglet.formats import DataConfig

    data_cfg = DataConfig(hidden_size=64, vocab_size=400, target_revision="abc", target="tiny")
    target_cfg = SimpleNamespace(**{"hidden_size": 64, "vocab_size": 400, field: value})
    from eaglet.target import TargetRef

    with pytest.raises(ValueError, match=f"{field}={value}"):
        check_target_matches(data_cfg, target_cfg, TargetRef("other", "other", "abc"))
    check_target_matches(data_cfg, SimpleNamespace(hidden_size=64, vocab_size=400), TargetRef("tiny", "tiny", "abc"))
    with pytest.raises(ValueError, match="target_revision='abd'.*another config, tokenizer or heads"):
        check_target_matches(data_cfg, SimpleNamespace(hidden_size=64, vocab_size=400), TargetRef("x", "x", "abd"))


# ---------------------------------------------------------------------------------------------
# Training efficiency options
# ---------------------------------------------------------------------------------------------


def test_sparse_teacher_is_cached_once_per_sample_and_exact(dataset, tiny_target):
    """The cached top-k teacher equals a fresh one computed from the stored state, whatever the
    batch it is first seen in, and the target's head runs once per sample."""
    from transformers import AutoModelForCausalLM

    from eaglet.drafter import build_draft_vocab, make_teacher, make_teacher_head
    from eaglet.training.data import load_batch
    from eaglet.training.teacher import TeacherSource

    ds = open_dataset(dataset)
    head = make_teacher_head(AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32), "pre_norm")
    d2t, t2d = build_draft_vocab(ds.token_freq, 400, 100)
    calls = []
    source = TeacherSource(head, d2t, t2d, top_k=4, features=False, bf16=False)
    source.lm_head.register_forward_hook(lambda *a: calls.append(1))  # the target's head, its rows reordered
    pair, single = load_batch(ds.files, [3, 5], None), load_batch(ds.files, [5], None)
    first = source(pair)
    assert len(calls) == 2 and set(source.cache) == {3, 5}
    again = source(single)
    assert len(calls) == 2  # from the cache
    n = ds.lengths[5]
    fresh = make_teacher(single.last_hidden.float(), head.final_norm, head.lm_head, d2t, t2d, top_k=4)
    row = pair.indices.index(5)
    for t in (first, again):
        r = row if t is first else 0
        assert torch.equal(t.ids[r, :n], fresh.ids[0]) and torch.equal(t.log_probs[r, :n], fresh.log_probs[0])
        assert torch.equal(t.in_draft[r, :n], fresh.in_draft[0]) and not t.in_draft[r, n:].any()
    packed, before = pack([read_samples(ds.files, [3, 5])], 512, [3, 5]), len(calls)
    in_pack = source(packed)
    assert len(calls) == before  # the same samples, packed: from the cache, at their offsets
    a = ds.lengths[3]
    assert torch.equal(in_pack.ids[0, a : a + n], fresh.ids[0]) and not in_pack.in_draft[0, a + n :].any()


def test_packs_hold_every_sample_once_within_the_budget():
    """Packs per epoch: every sample exactly once, none over the budget (a longer sample is cut
    to it), little padding, a seeded order; the stream counts each epoch's packs, so micro-batch
    m is the same whatever was asked before it."""
    from eaglet.training.data import packed_batches

    idx = list(range(300))
    lengths = {i: (i * 37) % 700 + 3 for i in idx}
    packs = packed_batches(idx, lengths, 1024, random.Random(1))
    assert sorted(i for p in packs for i in p) == idx
    assert all(sum(min(lengths[i], 1024) for i in p) <= 1024 for p in packs)
    assert sum(lengths.values()) / (len(packs) * 1024) > 0.9  # first-fit decreasing: under 10 % padding
    assert packs == packed_batches(idx, lengths, 1024, random.Random(1))
    assert packed_batches(idx, {**lengths, 0: 5000}, 1024, None)[0] == [0]  # cut to the budget, alone in its pack
    s1, s2 = BatchStream(idx, lengths, 2, 0, pack_tokens=1024), BatchStream(idx, lengths, 2, 0, pack_tokens=1024)
    far = [s1[m] for m in range(3 * s1.per_epoch)]
    assert s2[len(far) - 1] == far[-1] and all(len(b) <= 2 for b in far)  # rows of 2 packs
    epoch_0 = far[: s1.per_epoch]
    assert sorted(i for b in epoch_0 for row in b for i in row) == idx


@pytest.mark.parametrize("compile", [False, True])
def test_packed_training_resumes_exactly(dataset, tmp_path, compile):
    """--pack-tokens: a run stopped and resumed ends with the weights of the uninterrupted run (the
    packs follow the seed); compiled, its steps follow the eager run's loss, and train_config.json
    says they really ran compiled (inductor built a graph; a silent fall back to eager would not)."""
    opts = {**FAST, "batch_size": 1, "pack_tokens": 160, "compile": compile}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(TrainOptions(dataset_dir=dataset, out_dir=straight, total_steps=6, **opts), show_progress=False)
    if compile:
        eager = tmp_path / "eager"
        train(
            TrainOptions(dataset_dir=dataset, out_dir=eager, total_steps=6, **{**opts, "compile": False}),
            show_progress=False,
        )
        ran = [json.loads((run / "train_config.json").read_text()) for run in (straight, eager)]
        assert (ran[0]["compile"], ran[0]["compile_mode"]) == (True, "inductor") and ran[0]["compile_graphs"] >= 1
        assert (ran[1]["compile"], ran[1]["compile_mode"], ran[1]["compile_graphs"]) == (False, "eager", 0)
        loss = [[r["loss"][0] for r in iter_metrics(run) if r["split"] == "train"] for run in (straight, eager)]
        assert loss[0] == pytest.approx(loss[1], rel=2e-3)
        return
    train(TrainOptions(dataset_dir=dataset, out_dir=resumed, total_steps=6, stop_after=2, **opts), show_progress=False)
    train(TrainOptions(dataset_dir=dataset, out_dir=resumed, total_steps=6, resume=True, **opts), show_progress=False)
    a, b = run_weights(straight, 6), run_weights(resumed, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((straight / "train_config.json").read_text())
    assert config["pack_tokens"] == 160 and config["compile"] is False and config["compile_mode"] == "eager"


def test_time_budget_sizes_the_schedule(dataset, tmp_path):
    run = tmp_path / "run"
    summary = train(
        TrainOptions(
            dataset_dir=dataset, out_dir=run, time_budget=3.0, **{**FAST, "eval_every": None, "save_every": None}
        ),
        show_progress=False,
    )
    cfg = json.loads((run / "checkpoints" / "latest.json").read_text())
    state = torch.load(run / "checkpoints" / cfg["path"] / "training_state.pt", weights_only=True)
    assert state["plan"]["calibrated"] and state["plan"]["total_steps"] == summary.total_steps == summary.step
    written = json.loads((run / "train_config.json").read_text())  # the sized schedule, not the placeholder
    assert written["total_steps"] == summary.total_steps and written["warmup_steps"] == state["plan"]["warmup"]
    assert 0.5 < summary.seconds < 12  # about the budget (the estimate is made from the first steps)
    evals = [r for r in iter_metrics(run) if r["split"] == "eval"]
    assert evals and evals[-1]["step"] == summary.step and evals[-1]["train_seconds"] > 0
    with pytest.raises(ValueError, match="time-budget"):
        train(
            TrainOptions(dataset_dir=dataset, out_dir=tmp_path / "r2", time_budget=3.0, total_steps=5),
            show_progress=False,
        )


def test_ttt_ramp_lm_head_init_and_loss_on_all(dataset, tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from eaglet.training.config import TrainConfig

    cfg = TrainConfig(ttt_steps=3, ttt_ramp=0.5)
    assert [cfg.ttt_steps_at(s, 12) for s in range(0, 12, 2)] == [1, 2, 3, 3, 3, 3]
    run = tmp_path / "run"
    train(
        TrainOptions(
            dataset_dir=dataset,
            out_dir=run,
            total_steps=6,
            lm_head_init="target",
            freeze_lm_head=True,
            loss_on="all",
            teacher_top_k=8,
            **{**FAST, "eval_every": 6, "save_every": 6},
        ),
        show_progress=False,
    )
    w = run_weights(run, 6)
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    ids = torch.arange(w["d2t"].shape[0]) + w["d2t"]
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight[ids].detach())  # frozen: still the target's rows
    assert torch.equal(w["norm.weight"], target.model.norm.weight.detach())
    train_rec = [r for r in iter_metrics(run) if r["split"] == "train"]
    eval_rec = [r for r in iter_metrics(run) if r["split"] == "eval"]
    assert train_rec[0]["positions"][0] > eval_rec[0]["positions"][0]  # all tokens vs the assistant's only
    with pytest.raises(ValueError, match="lm-head-init target"):
        TrainConfig(freeze_lm_head=True)


def test_evaluate_heldout_measures_any_drafter_on_a_datasets_split(dataset, tmp_path):
    from eaglet.training.heldout import evaluate_heldout

    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=dataset, out_dir=run, total_steps=4, **FAST), show_progress=False)
    last = [r for r in iter_metrics(run) if r["split"] == "eval"][-1]
    best = formats.read_json(run / "checkpoints" / "best.json")
    assert best["step"] == 4 or last["tau"] <= best["tau"]
    r = evaluate_heldout(run / "checkpoints" / "step_00000004", dataset, eval_fraction=0.1, ttt_steps=3)
    assert r["acc"] == pytest.approx(last["acc"]) and r["positions"] == last["positions"]


def test_auto_dtype_is_bf16_only_where_fast(monkeypatch):
    from eaglet.options import parse_duration
    from eaglet.target import FAST_BF16_ENV, fast_bf16, parse_dtype

    for flag, expected in (("1", torch.bfloat16), ("0", torch.float32)):
        monkeypatch.setenv(FAST_BF16_ENV, flag)
        assert fast_bf16("cpu") == (flag == "1") and parse_dtype("auto", "cpu") == expected
    assert parse_dtype("fp32", "cpu") == torch.float32
    monkeypatch.setenv(FAST_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=f"{FAST_BF16_ENV}='yes': set it to 1"):
        fast_bf16("cpu")
    monkeypatch.delenv(FAST_BF16_ENV)  # the detection itself answers without error on any machine
    assert isinstance(fast_bf16("cpu"), bool)
    assert (parse_duration("90"), parse_duration("1.5m"), parse_duration("2h")) == (90.0, 90.0, 7200.0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"total_steps": 0}, "--total-steps 0: must be >= 1"),
        ({"draft_vocab_size": 0}, "--draft-vocab-size 0: must be >= 1"),
        ({"batch_size": 0}, "--batch-size 0: must be >= 1"),
        ({"ttt_steps": 0}, "--ttt-steps 0: must be >= 1"),
        ({"max_length": -5}, "--max-length -5: must be >= 1"),
        ({"eval_fraction": 1.5}, r"--eval-fraction 1.5: must be in \[0, 1\): the share of samples held out"),
        ({"eval_fraction": -0.5}, r"--eval-fraction -0.5: must be in \[0, 1\)"),
        ({"lr": 0.0}, "--lr 0.0: must be > 0"),
        ({"lr": float("nan")}, "--lr nan: must be > 0"),
        ({"warmup_steps": -1}, "--warmup-steps -1: must be >= 0"),
    ],
)
def test_train_options_are_validated_in_one_place(options, message, tmp_path):
    """TrainConfig refuses out-of-range numbers itself, so the CLI, recipes and the Python entry
    function all get the same one-line error (instead of a full epoch or a torch traceback)."""
    from eaglet.training.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)
    with pytest.raises(ValueError, match=message):
        train(
            TrainOptions(dataset_dir=tmp_path / "no-such-dataset", out_dir=tmp_path / "no-such-run", **options),
            show_progress=False,
        )
    assert not any(tmp_path.iterdir())  # refused before anything is written


class FakeRank:
    """A non-main rank of a 2-process group whose collectives answer with rank 0's values."""

    world, main = 2, False

    def __init__(self, rank0_values: list[int]):
        self.rank0_values, self.calls = list(rank0_values), 0

    def from_main(self, value: int) -> int:
        self.calls += 1
        return self.rank0_values.pop(0)


def test_time_budget_calibration_follows_rank_0_on_every_rank():
    """Each process times its own steps; when rank 0 sizes the schedule, another rank that has not
    timed enough yet must take part in the same broadcasts (else both wait forever) and adopt rank
    0's plan; while rank 0 is not ready, no rank sizes anything."""
    from types import SimpleNamespace

    from eaglet.training.config import Calibration, Plan, TrainConfig
    from eaglet.training.loop import RunState, calibrate_budget

    cfg = TrainConfig(time_budget=600)
    bar = SimpleNamespace(reset=lambda total: None, update=lambda n: None)
    progress = SimpleNamespace(calibration=Calibration(start=10**9), bar=bar)  # this rank never timed enough
    state = RunState(Plan.first(cfg, 100), None, step=5)
    run = SimpleNamespace(cfg=cfg, dist=FakeRank([0]), split=SimpleNamespace(tokens_per_step=100.0))
    calibrate_budget(run, state, progress)  # rank 0 not ready: one broadcast, the plan stays open
    assert run.dist.calls == 1 and not state.plan.calibrated
    run.dist = FakeRank([1, 321])  # rank 0 is ready and sized 321 steps
    calibrate_budget(run, state, progress)
    assert run.dist.calls == 2 and state.plan.calibrated and state.plan.total_steps == 321
    calibrate_budget(run, state, progress)  # sized once: no more collectives
    assert run.dist.calls == 2


def test_time_budget_resizes_the_plan_at_the_rate_of_the_last_steps():
    """The first steps run slower (kernels warming up, the first epoch read from disk): every
    RESIZE_STEPS steps until half the budget is spent, the plan is sized again at the rate of those
    steps, keeping its warm-up; a rate within RESIZE_SLACK leaves it as it was."""
    from types import SimpleNamespace

    from eaglet.training.config import RESIZE_STEPS, Plan, TrainConfig
    from eaglet.training.loop import RunState, resize_budget

    cfg = TrainConfig(time_budget=600)
    bar = SimpleNamespace(reset=lambda total: None, update=lambda n: None)
    # sized at step 20 after 10 s, at 100 tokens a step and 200 tok/s: 20 + 590 * 200 / 100 = 1200 steps
    for later_rate, resized in ((300.0, True), (202.0, False)):
        state = RunState(Plan.sized(cfg, 1200, 20), None, step=20)
        warmup = state.plan.warmup
        state.done.update(tokens=2000, seconds=10.0)
        progress = SimpleNamespace(bar=bar, resize_from=(20, 2000, 10.0))
        run = SimpleNamespace(cfg=cfg, dist=FakeRank([]), split=SimpleNamespace(tokens_per_step=100.0))
        state.step, state.done["tokens"] = 20 + RESIZE_STEPS - 1, 2000 + 100 * (RESIZE_STEPS - 1)
        resize_budget(run, state, progress)  # not yet timed long enough: nothing, no broadcast
        assert run.dist.calls == 0 and state.plan.total_steps == 1200
        state.step, state.done["tokens"] = 20 + RESIZE_STEPS, 2000 + 100 * RESIZE_STEPS
        state.done["seconds"] = 10.0 + 100 * RESIZE_STEPS / later_rate
        expected = state.step + int((600 - state.done["seconds"]) * later_rate / 100)
        run.dist = FakeRank([1, expected])  # rank 0: still timing, and its plan
        resize_budget(run, state, progress)
        assert run.dist.calls == 2 and state.plan.warmup == warmup
        assert state.plan.total_steps == (expected if resized else 1200), later_rate
        assert progress.resize_from == (state.step, state.done["tokens"], state.done["seconds"])  # the next window
        resize_budget(run, state, progress)  # not again until RESIZE_STEPS more steps
        assert run.dist.calls == 2
    state.done["seconds"] = 100.0  # this rank has spent less than half the budget, rank 0 more (its seconds
    state.step += RESIZE_STEPS  # decide, so that every rank stops taking part at the same step)
    run.dist = FakeRank([0, 10**6])
    resize_budget(run, state, progress)
    assert progress.resize_from is None
