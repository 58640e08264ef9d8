"""Numbers with bounds, and recipe files and stage markers that cannot be read: each refused where
it is parsed, in one line that names the option or the file and what to do, never an
OverflowError, an allocator failure, a UnicodeDecodeError or a KeyError."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from eaglet.check import check_dataset
from eaglet.cli import main
from eaglet.evaluate import DecodeSettings, evaluate
from eaglet.extract import extract
from eaglet.prepare import prepare
from eaglet.recipe import Paths, RecipeSummary, apply_scale, finished_stages, load_recipe, run_recipe, summary_lines
from eaglet.regen import regenerate
from eaglet.target import TargetRef
from eaglet.training import config
from eaglet.training.config import (
    TrainConfig,
    meminfo_available,
    refuse_unfit_micro_batch,
    resolve_packing,
    token_state_bytes,
)
from eaglet.training.loop import train
from eaglet.options import (
    CheckOptions,
    EvalOptions,
    ExtractOptions,
    PrepareOptions,
    RegenOptions,
    RunOptions,
    TrainOptions,
)

INF, NAN = float("inf"), float("nan")


# ---------------------------------------------------------------------------------------------
# Numbers: finite and in range, on the command line, in recipes and from Python
# ---------------------------------------------------------------------------------------------


def argv_of(stage: str, tmp_path: Path) -> list[str]:
    """A command of `stage` whose inputs do not exist: a number the parser lets through fails fast
    on them instead, with another message."""
    missing = str(tmp_path / "missing")
    return {
        "train": ["train", missing, "--out", str(tmp_path / "run")],
        "run": ["run", "demo", "--out", str(tmp_path / "run")],
        "demo": ["demo", "--out", str(tmp_path / "run")],
        "regen": ["regen", "--data", f"{missing}.jsonl", "--out", str(tmp_path / "out.jsonl")],
        "eval": ["eval", missing, "--no-plot"],
        "check": ["check", missing],
    }[stage]


@pytest.mark.parametrize(
    "stage, option, value",
    [
        ("train", "--epochs", "inf"),
        ("train", "--lr", "nan"),
        ("train", "--max-grad-norm", "-inf"),
        ("train", "--eval-fraction", "nan"),
        ("train", "--time-budget", "inf"),
        ("run", "--scale", "inf"),
        ("run", "--scale", "nan"),
        ("demo", "--scale", "-inf"),
        ("regen", "--temperature", "inf"),
        ("regen", "--top-p", "nan"),
        ("regen", "--timeout", "inf"),
        ("regen", "--time-budget", "nan"),
        ("eval", "--min-draft-prob", "nan"),
        ("eval", "--temperature", "-inf"),
        ("eval", "--top-p", "inf"),
    ],
)
def test_the_parser_refuses_non_finite_numbers(stage, option, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv_of(stage, tmp_path), f"{option}={value}"])  # "-inf" alone would read as an option
    assert e.value.code == 2
    assert f"argument {option}: '{value}': " in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything ran


@pytest.mark.parametrize(
    "stage, option, value, message",
    [
        ("train", "--epochs", "-1", "--epochs -1.0: must be > 0"),
        ("train", "--seed", "-1", "--seed -1: must be in [0, 18446744073709551615]: the seeds torch takes"),
        ("train", "--pack-tokens", "-3", "--pack-tokens -3: must be >= 1 (or 0: one sample per row)"),
        ("run", "--scale", "0", "--scale 0.0: must be in (0, 1000000.0]: data sizes no run reaches beyond"),
        ("regen", "--top-p", "1.5", "--top-p 1.5: must be in (0, 1]"),
        ("eval", "--min-draft-prob", "2", "--min-draft-prob 2.0: must be in [0, 1]"),
        ("check", "--max-per-kind", "-1", "--max-per-kind -1: must be >= 0"),
    ],
)
def test_the_command_line_refuses_numbers_out_of_range(stage, option, value, message, tmp_path, capsys):
    assert main([*argv_of(stage, tmp_path), option, value]) == 2
    assert capsys.readouterr().err.strip() == f"eaglet {stage}: error: {message}"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda d: TrainConfig(epochs=INF), "--epochs inf: must be > 0 and finite"),
        (
            lambda d: train(TrainOptions(dataset_dir=d / "data", out_dir=d / "run", lr=NAN), show_progress=False),
            "--lr nan: must be > 0 and finite",
        ),
        (
            lambda d: train(
                TrainOptions(dataset_dir=d / "data", out_dir=d / "run", warmup_steps=INF), show_progress=False
            ),
            "--warmup-steps inf: must be >= 0 and finite",
        ),
        (
            lambda d: train(
                TrainOptions(dataset_dir=d / "data", out_dir=d / "run", total_steps=INF), show_progress=False
            ),
            "--total-steps inf: must be >= 1 and finite",
        ),
        (
            lambda d: train(
                TrainOptions(dataset_dir=d / "data", out_dir=d / "run", pack_tokens=INF), show_progress=False
            ),
            r"--pack-tokens inf: must be >= 1 \(or 0: one sample per row\) and finite",
        ),
        (
            lambda d: train(TrainOptions(dataset_dir=d / "data", out_dir=d / "run", seed=2**64), show_progress=False),
            r"--seed 18446744073709551616: must be in \[0, 18446744073709551615\]: the seeds torch takes",
        ),
        (
            lambda d: run_recipe(RunOptions(spec="demo", out=d / "run", scale=INF)),
            r"--scale inf: must be in \(0, 1000000.0\] and finite: data sizes no run reaches beyond",
        ),
        (
            lambda d: run_recipe(RunOptions(spec="demo", out=d / "run", scale=NAN)),
            r"--scale nan: must be in \(0, 1000000.0\] and finite: data sizes no run reaches beyond",
        ),
        (
            lambda d: regenerate(RegenOptions(data=d / "chats.jsonl", out=d / "out.jsonl", temperature=INF)),
            "--temperature inf: must be >= 0 and finite",
        ),
        (
            lambda d: regenerate(RegenOptions(data=d / "chats.jsonl", out=d / "out.jsonl", timeout=INF)),
            "--timeout inf: must be > 0 and finite",
        ),
        (
            lambda d: regenerate(RegenOptions(data=d / "chats.jsonl", out=d / "out.jsonl", max_new_tokens=-INF)),
            "--max-new-tokens -inf: must be >= 1 and finite",
        ),
        (
            lambda d: evaluate(EvalOptions(drafter_path=d / "drafter", temperature=INF, plot=False)),
            "--temperature inf: must be >= 0 and finite",
        ),
        (
            lambda d: evaluate(EvalOptions(drafter_path=d / "drafter", num_prompts=INF, plot=False)),
            "--num-prompts inf: must be >= 1 and finite",
        ),
        (lambda d: DecodeSettings(max_new_tokens=INF), "--max-new-tokens inf: must be >= 1 and finite"),
        (
            lambda d: prepare(PrepareOptions(target=None, data=d / "chats.jsonl", out=d / "prepared", max_length=INF)),
            "--max-length inf: must be >= 1 and finite",
        ),
        (
            lambda d: extract(ExtractOptions(prepared=d / "prepared", out=d / "data", batch_tokens=INF)),
            "--batch-tokens inf: must be >= 1 and finite",
        ),
        (
            lambda d: check_dataset(CheckOptions(path=d / "data", identity_samples=INF)),
            "--identity-samples inf: must be >= 0 and finite",
        ),
    ],
)
def test_entry_functions_refuse_non_finite_numbers(call, message, tmp_path):
    """Python callers pass floats the parser never sees: every range rule refuses inf and nan
    (a bare `inf >= 1` passes), with the option's name."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        call(tmp_path)


@pytest.mark.parametrize(
    "table, line, error",
    [
        ("train", "epochs = inf", r"\[train\]\.epochs: inf is not a finite number"),
        ("train", "lr = nan", r"\[train\]\.lr: nan is not a finite number"),
        ("regen", "temperature = -inf", r"\[regen\]\.temperature: -inf is not a finite number"),
        ("eval", "top_p = nan", r"\[eval\]\.top_p: nan is not a finite number"),
        ("train", "epochs = -1", r"\[train\]: --epochs -1: must be > 0$"),
        ("train", "ttt_ramp = 1.5", r"\[train\]: --ttt-ramp 1\.5: must be in \[0, 1\): a fraction of the schedule$"),
        ("eval", "min_draft_prob = 2.0", r"\[eval\]: --min-draft-prob 2\.0: must be in \[0, 1\]$"),
        ("prepare", "max_length = -5", r"\[prepare\]: --max-length -5: must be >= 1$"),
        ("extract", "batch_tokens = 0", r"\[extract\]: --batch-tokens 0: must be >= 1$"),
        ("check", "identity_samples = -1", r"\[check\]: --identity-samples -1: must be >= 0$"),
        ("regen", "max_turns = 0", r"\[regen\]: --max-turns 0: must be >= 1$"),
    ],
)
def test_recipes_refuse_numbers_before_any_stage(table, line, error, tmp_path):
    """TOML has inf and nan, and a number out of range in any stage's table would otherwise stop the
    recipe only when that stage starts, after every stage before it ran: both refused before the
    first stage, naming the recipe, the table and the option."""
    recipe = tmp_path / "bad.toml"
    recipe.write_text(
        '[regen]\ndata = "chats.jsonl"\n\n[prepare]\n\n[extract]\n\n[check]\n\n[train]\n\n[eval]\n'.replace(
            f"[{table}]\n", f"[{table}]\n{line}\n"
        )
    )
    with pytest.raises(ValueError, match=r"bad\.toml " + error):
        run_recipe(RunOptions(spec=recipe, out=tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["train.lr=nan", "regen.top_p=inf", "eval.temperature=-inf"])
def test_a_set_override_that_is_not_finite_is_named(override, tmp_path, capsys):
    text = override.partition("=")[2]
    assert main(["run", "demo", "--set", override, "--out", str(tmp_path / "run")]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"demo.toml): {text} is not a finite number; write a number such as 1.0 (no option takes inf or nan)")
    )
    assert not (tmp_path / "run").exists()


def test_scale_that_overflows_a_scaled_option_is_refused():
    recipe = {"scale": {"multiply": ["regen.num_samples"]}, "regen": {"num_samples": 1e303}}
    with pytest.raises(
        ValueError,
        match=r"^--scale 1e\+06: regen\.num_samples = 1e\+303 times it is "
        r"beyond any number; use a smaller --scale$",
    ):
        apply_scale(recipe, 1e6)
    with pytest.raises(ValueError, match=r"^--scale 1e\+300: must be in \(0, 1000000.0\]: data sizes no run"):
        apply_scale(recipe, 1e300)


# ---------------------------------------------------------------------------------------------
# A training micro-batch within the memory the machine has
# ---------------------------------------------------------------------------------------------

GIB = 2**30


@pytest.fixture
def one_gib(monkeypatch):
    """The training device has 1 GiB available, whatever this machine has."""
    monkeypatch.setattr(config, "available_memory", lambda device: (GIB, "MemAvailable"))


def test_a_micro_batch_beyond_memory_is_refused_with_the_bytes_it_needs(one_gib):
    cfg = TrainConfig(pack_tokens=1_000_000_000)
    per_token = (4 + cfg.ttt_steps) * 2048 * 2  # the target's 4 states + a drafter output per TTT step, bf16
    assert token_state_bytes(2048, cfg.ttt_steps) == per_token
    with pytest.raises(
        ValueError,
        match=(
            rf"^--pack-tokens 1000000000: one micro-batch of 1,000,000,000 tokens needs at least "
            rf"{1_000_000_000 * per_token:,} bytes \(22\.35 TiB\) for its hidden states alone \(.*{per_token:,} bytes "
            rf"a token\), this machine has {GIB:,} bytes \(1\.00 GiB\) available \(MemAvailable\); lower "
            rf"--pack-tokens or --batch-size$"
        ),
    ):
        refuse_unfit_micro_batch(cfg, 500, 2048, "cpu")
    with pytest.raises(ValueError, match=r"^--pack-tokens 65536 x --batch-size 8: one micro-batch of 524,288 tokens"):
        refuse_unfit_micro_batch(TrainConfig(pack_tokens=65536, batch_size=8), 500, 2048, "cpu")
    # unpacked: --batch-size samples padded to the longest
    with pytest.raises(
        ValueError,
        match=r"^--batch-size 64 x samples of up to 100,000 tokens: one micro-batch of "
        r"6,400,000 tokens .*; lower --batch-size, or --max-length$",
    ):
        refuse_unfit_micro_batch(TrainConfig(batch_size=64, pack_tokens=0), 100_000, 2048, "cpu")
    # the default pack follows the data: a sample of 10M tokens makes a pack of 10M
    with pytest.raises(ValueError, match=r"^--pack-tokens 10000128: one micro-batch of 10,000,128 tokens"):
        refuse_unfit_micro_batch(resolve_packing(TrainConfig(), 10_000_000), 10_000_000, 2048, "cpu")


def test_a_micro_batch_that_fits_or_memory_unknown_passes(one_gib, monkeypatch):
    refuse_unfit_micro_batch(TrainConfig(pack_tokens=4096, batch_size=4), 500, 2048, "cpu")  # 192 MiB of states
    refuse_unfit_micro_batch(TrainConfig(pack_tokens=0, batch_size=1), 2048, 4096, "cuda:0")
    monkeypatch.setattr(config, "available_memory", lambda device: None)  # no /proc/meminfo, another device
    refuse_unfit_micro_batch(TrainConfig(pack_tokens=10**12), 500, 2048, "mps")


def test_available_memory_reads_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    monkeypatch.setattr(config, "MEMINFO", meminfo)
    assert config.available_memory("cpu") == (8_000_000 * 1024, "MemAvailable")
    assert meminfo_available("MemTotal: 1 kB\n") is None
    monkeypatch.setattr(config, "MEMINFO", tmp_path / "none")
    assert config.available_memory("cpu") is None and config.available_memory("mps") is None


# ---------------------------------------------------------------------------------------------
# Recipe files and stage markers that cannot be read
# ---------------------------------------------------------------------------------------------


def test_a_recipe_that_is_not_utf8_is_named(tmp_path, capsys):
    recipe = tmp_path / "latin1.toml"
    recipe.write_bytes('[recipe]\ndescription = "caf\u00e9"\n'.encode("latin-1"))
    error = rf"^{recipe}: not UTF-8 text \(byte 0xe9 at offset 27\); TOML is UTF-8: save the recipe as UTF-8$"
    with pytest.raises(ValueError, match=error):
        load_recipe(recipe)
    recipe.write_bytes(b"\xff\xfe[train]\n")  # UTF-16's byte order mark
    assert main(["run", str(recipe), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"eaglet run: error: {recipe}: not UTF-8 text (byte 0xff at offset 0); TOML is UTF-8: save the recipe as UTF-8"
    )


def test_a_recipe_with_a_bom_is_read_and_one_without_stages_is_refused(tmp_path, capsys):
    recipe = tmp_path / "bom.toml"
    recipe.write_bytes(b"\xef\xbb\xbf[prepare]\nmax_length = 64\n")  # as many Windows editors save UTF-8
    assert load_recipe(recipe)["prepare"] == {"max_length": 64}
    recipe.write_bytes(b"\xef\xbb\xbf# nothing to run yet\n")
    assert main(["run", str(recipe), "--out", str(tmp_path / "run")]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(f"eaglet run: error: {recipe}: names no stage; add a table for each stage to run: regen, prepare")
    )
    assert not (tmp_path / "run").exists()
    os.mkfifo(tmp_path / "fifo")
    assert main(["run", str(tmp_path / "fifo"), "--out", str(tmp_path / "run")]) == 2
    assert "fifo': not a regular file; give a .toml file" in capsys.readouterr().err


MARKER = {
    "options": {"data": "chats.jsonl"},
    "result": {"samples": 3, "tokens": 90, "assistant_tokens": 40},
    "seconds": 2.0,
    "target": {"name": "t", "revision": "r"},
}


def without(key: str) -> str:
    return json.dumps({k: v for k, v in MARKER.items() if k != key})


@pytest.mark.parametrize(
    "text, problem",
    [
        (without("options"), "it has no 'options'"),
        (without("result"), "it has no 'result'"),
        (without("seconds"), "it has no 'seconds'"),
        (json.dumps({**MARKER, "options": ["data"]}), r"its 'options' is \[\"data\"\], not a JSON object"),
        (json.dumps({**MARKER, "seconds": "2"}), "its 'seconds' is \"2\", not a number"),
        (json.dumps({**MARKER, "target": "t"}), "its 'target' is \"t\", not an object with a name and a revision"),
        (json.dumps([MARKER]), "it holds a JSON list, not an object"),
        (json.dumps(MARKER)[:40], r"not valid JSON \(Unterminated string.*\)"),
        ("", r"not valid JSON \(Expecting value: line 1 column 1 \(char 0\)\)"),
        (
            '{"options": {}}'.encode("utf-16"),
            r"not valid JSON \('utf-8' codec can't decode byte 0xff in position 0: .*\)",
        ),
    ],
)
def test_a_stage_marker_that_cannot_be_read_is_named_with_the_fix(text, problem, tmp_path):
    paths = Paths(tmp_path / "run")
    marker = paths.marker("prepare")
    marker.parent.mkdir(parents=True)
    marker.write_bytes(text if isinstance(text, bytes) else text.encode())
    recipe = {"prepare": MARKER["options"]}
    with pytest.raises(
        ValueError,
        match=rf"^{marker}: not a readable stage marker: {problem}; delete it and the "
        r"same command reruns that stage$",
    ):
        finished_stages(recipe, paths, TargetRef("t", "t", "r"))
    marker.write_text(json.dumps(MARKER))  # whole again: reused
    assert finished_stages(recipe, paths, TargetRef("t", "t", "r"))["prepare"]["seconds"] == 2.0


def test_a_reused_marker_without_figures_still_gives_a_summary(tmp_path):
    """A marker from another version may record other figures: the summary, written after every
    stage ran, says so rather than ending the run on a KeyError."""
    summary = RecipeSummary(
        "r",
        tmp_path,
        {
            "prepare": {**MARKER, "result": {"samples": 3}, "reused": True},
            "extract": {**MARKER, "result": {"samples": 1, "tokens": None, "bytes": 1}, "reused": True},
        },
    )
    lines = summary_lines(summary)
    assert lines[3].endswith("(its marker's result has no 'tokens')  (reused)")
    assert lines[4].endswith("(its marker's result holds figures of another form)  (reused)")
    assert lines[-1].split()[-1] == "0m04s"


@pytest.mark.parametrize(
    "options,given", [({"epochs": 1e30}, "--epochs 1e+30"), ({"total_steps": 2**41}, f"--total-steps {2**41}")]
)
def test_a_schedule_that_never_ends_is_refused(options, given):
    """Finite and in range, and still no plan: 1e30 epochs sizes ~1e30 steps that no machine finishes."""
    from eaglet.training.config import Plan, TrainConfig

    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(given)}: a schedule of [\d,]+ optimizer steps, more than the "
        r"1,099,511,627,776 eaglet plans; give fewer, or --time-budget$",
    ):
        Plan.first(TrainConfig(**options), int(min(options.get("epochs", 1) * 100, 2**62)))


def test_default_aux_ids_are_valid_for_every_target_depth():
    """(2, N//2, N-3) is not three distinct ids below 7 layers: a 4-layer target got 2,2,1."""
    from eaglet import layers

    for n in range(4, 200):
        assert layers.check_aux_ids(layers.default_aux_ids(n), n) == layers.default_aux_ids(n)
    assert layers.default_aux_ids(32) == [2, 16, 29]  # EAGLE-3's own choice where it is one
    with pytest.raises(ValueError, match="a target of 3 layers has no three distinct layers"):
        layers.default_aux_ids(3)


def test_sizes_no_run_reaches_are_refused_by_option():
    """--total-tokens 10^9 reached torch as a tensor of negative size; regen's --max-new-tokens
    10^12 left every chat "more than the -999999997952 allowed"."""
    from eaglet.evaluate.settings import DecodeSettings

    for option, value in (
        ("total_tokens", 10**9),
        ("chain_depth", 100_000),
        ("lookup_tokens", 10**9),
        ("max_new_tokens", 10**12),
    ):
        with pytest.raises(ValueError, match=rf"--{option.replace('_', '-')} {value}: must be in \[1, "):
            DecodeSettings(**{option: value})
