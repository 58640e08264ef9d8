"""One writer per output, every stage: a second writer is refused at once naming the holder, a
dead holder (SIGKILL) releases the output, shards meant to run side by side still do, and a lock
path that is a folder or a dangling link is named. A kill's torn last line of metrics.jsonl is
dropped on resume; a prepare cut short before its config is replaced by the rerun; `check` with
options that ask for the target fails when the target cannot be loaded."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import write_jsonl
from eaglet import formats
from eaglet.check import check_dataset
from eaglet.convert import convert
from eaglet.export import export_drafter, import_drafter
from eaglet.extract import extract
from eaglet.prepare import prepare
from eaglet.recipe import run_recipe
from eaglet.regen import regenerate
from eaglet.training.checkpoints import iter_metrics
from eaglet.training.loop import train
from helpers import FAST, chat_records
from eaglet.options import (
    CheckOptions,
    ConvertOptions,
    ExportOptions,
    ExtractOptions,
    ImportOptions,
    PrepareOptions,
    RegenOptions,
    RunOptions,
    TrainOptions,
)

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from eaglet import formats
    out, stage, lock = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    with formats.output_lock(out, stage, lock=Path(lock)):
        print("held", flush=True)
        time.sleep(300)
""")


class Holder:
    """Another eaglet process holding an output's lock until killed (SIGKILL: no cleanup runs)."""

    def __init__(self, out: Path, stage: str, lock: Path | None = None):
        lock = lock or formats.lock_path(out)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(out), stage, str(lock)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "held"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def work(tiny_target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("writers")
    chats = write_jsonl(root / "chats.jsonl", chat_records(8))
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats), out=root / "prep", max_length=256))
    extract(ExtractOptions(prepared=root / "prep", out=root / "data", target=str(tiny_target)), show_progress=False)
    train(TrainOptions(dataset_dir=root / "data", out_dir=root / "run", total_steps=4, **FAST), show_progress=False)
    return {"chats": chats, "prep": root / "prep", "data": root / "data", "run": root / "run"}


def stage_calls(work: dict[str, Path], target: Path, out: Path) -> dict[str, object]:
    """Each writing stage, writing `out`."""
    return {
        "prepare": lambda: prepare(
            PrepareOptions(target=str(target), data=str(work["chats"]), out=out, max_length=256)
        ),
        "regen": lambda: regenerate(
            RegenOptions(
                data=str(work["chats"]), out=out, backend="local", target=str(target), max_new_tokens=4, num_samples=1
            )
        ),
        "convert": lambda: convert(
            ConvertOptions(src=work["data"], out=out, layout="compact", target=str(target)), show_progress=False
        ),
        "export": lambda: export_drafter(ExportOptions(ckpt=work["run"], out=out, fmt="eagle", dtype="fp32")),
        "import": lambda: import_drafter(ImportOptions(src=work["run"] / "checkpoints" / "step_00000004", out=out)),
        "run": lambda: run_recipe(RunOptions(spec=recipe_file(out.parent, target), out=out)),
    }


def recipe_file(folder: Path, target: Path) -> Path:
    path = folder / "r.toml"
    path.write_text(
        f'[recipe]\nname = "r"\ntarget = "{target}"\n\n[prepare]\ndata = "{folder / "c.jsonl"}"\nmax_length = 128\n'
    )
    write_jsonl(folder / "c.jsonl", chat_records(3))
    return path


@pytest.mark.parametrize("stage", ["prepare", "regen", "convert", "export", "import", "run"])
def test_a_second_writer_is_refused_and_a_dead_one_releases(stage, work, tiny_target, tmp_path):
    out = tmp_path / ("out.jsonl" if stage == "regen" else "out")
    call = stage_calls(work, tiny_target, out)[stage]
    holder = Holder(out, "somestage")
    try:
        with pytest.raises(
            formats.OutputBusy,
            match=rf"^{out}: another `eaglet somestage` \(pid {holder.proc.pid} on "
            r".*\) is writing it; wait for it to end, or write to another "
            r"--out$",
        ):
            call()
        assert not out.exists()  # refused before anything was written
    finally:
        holder.kill()
    call()  # the holder died: its lock died with it
    assert out.exists() and not formats.lock_path(out).exists()  # a writer that ends removes its lock file


def test_an_output_reached_through_a_link_has_the_same_lock(work, tmp_path):
    out, alias = tmp_path / "out", tmp_path / "alias"
    out.mkdir()
    alias.symlink_to(out)
    holder = Holder(out, "export")
    try:
        with pytest.raises(formats.OutputBusy, match=rf"^{alias}: another `eaglet export`"):
            export_drafter(ExportOptions(ckpt=work["run"], out=alias, fmt="eagle", dtype="fp32"))
    finally:
        holder.kill()


def test_extract_shards_write_side_by_side_but_one_shard_has_one_writer(work, tiny_target, tmp_path):
    out = tmp_path / "data"
    holder = Holder(out, "extract", formats.lock_path(out, "shard-0-of-2"))
    try:
        with pytest.raises(formats.OutputBusy, match="another `eaglet extract`"):
            extract(
                ExtractOptions(prepared=work["prep"], out=out, target=str(tiny_target), num_shards=2, shard_id=0),
                show_progress=False,
            )
        summary = extract(
            ExtractOptions(prepared=work["prep"], out=out, target=str(tiny_target), num_shards=2, shard_id=1),
            show_progress=False,
        )
        assert summary.written > 0
    finally:
        holder.kill()
    extract(
        ExtractOptions(prepared=work["prep"], out=out, target=str(tiny_target), num_shards=2, shard_id=0),
        show_progress=False,
    )
    assert check_dataset(CheckOptions(path=out, use_target=False)).clean


@pytest.mark.parametrize("odd", ["folder", "dangling link"])
def test_a_lock_path_that_is_not_a_file_is_named(odd, work, tmp_path):
    out = tmp_path / "out"
    lock = formats.lock_path(out)
    if odd == "folder":
        lock.mkdir()
    else:
        lock.symlink_to(tmp_path / "nowhere")
    what = "a folder" if odd == "folder" else rf"a symbolic link \(to {tmp_path / 'nowhere'}\)"
    with pytest.raises(OSError, match=rf"{lock}: {what}, not eaglet's lock file; remove it"):
        export_drafter(ExportOptions(ckpt=work["run"], out=out, fmt="eagle", dtype="fp32"))
    run = tmp_path / "run"  # a run folder's own lock, OUT/.lock, likewise
    (run / ".lock").mkdir(parents=True)
    with pytest.raises(OSError, match=rf"{run / '.lock'}: a folder, not eaglet's lock file; remove it"):
        train(TrainOptions(dataset_dir=work["data"], out_dir=run, total_steps=1, **FAST), show_progress=False)


def test_a_torn_metrics_line_is_dropped_on_resume(work, tmp_path, caplog):
    """A kill mid-write leaves a last metrics line without its newline: resume drops it, with a
    warning naming the file; a damaged line elsewhere is an error naming file and line."""
    run = tmp_path / "run"
    train(TrainOptions(dataset_dir=work["data"], out_dir=run, total_steps=4, **FAST), show_progress=False)
    metrics = run / "metrics.jsonl"
    whole = metrics.read_bytes()
    metrics.write_bytes(whole + b'{"step": 6, "split": "tr')
    assert [r["step"] for r in iter_metrics(run)] == [r["step"] for r in map(json.loads, whole.splitlines())]
    assert "dropping a partial last line" in caplog.text and str(metrics) in caplog.text
    # the run's own settings: nothing left to do
    train(TrainOptions(dataset_dir=work["data"], out_dir=run, resume=True), show_progress=False)
    assert metrics.read_bytes() == whole
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(lines[0] + b"garbage\n" + b"".join(lines[1:]))
    with pytest.raises(ValueError, match=rf"{metrics}:2: not a JSON line"):
        list(iter_metrics(run))


def test_a_prepare_killed_before_its_config_is_replaced_by_the_rerun(tiny_target, tmp_path):
    """SIGKILL inside the atomic write of prepare_config.json (written last): the folder holds
    prepared.jsonl and no config; the same command again finishes it, without --overwrite."""
    out, chats = tmp_path / "prep", write_jsonl(tmp_path / "chats.jsonl", chat_records(4))
    script = textwrap.dedent(f"""
        import os, signal
        from eaglet.formats import io
        real = io.write_json_atomic
        def killed(path, obj):
            if str(path).endswith("prepare_config.json"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path, obj)
        io.write_json_atomic = killed
        import eaglet.formats.prepared as prepared
        prepared.write_json_atomic = killed
        from eaglet.options import PrepareOptions
        from eaglet.prepare import prepare
        prepare(PrepareOptions(target={str(tiny_target)!r}, data={str(chats)!r}, out={str(out)!r}, max_length=256))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (out / formats.PREPARED_FILE).exists() and not (out / formats.PREPARE_CONFIG_FILE).exists()
    summary = prepare(PrepareOptions(target=str(tiny_target), data=str(chats), out=out, max_length=256))
    assert summary.samples == 4 and (out / formats.PREPARE_CONFIG_FILE).exists()
    with pytest.raises(FileExistsError, match="--overwrite"):  # a finished one is still never replaced silently
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats), out=out, max_length=256))


def test_check_fails_when_options_that_ask_for_the_target_cannot_load_it(work):
    """--device-map with the recorded target: asked for, so not run is not clean (100 KB of memory and no
    offload folder: the weights have nowhere to go)."""
    report = check_dataset(CheckOptions(path=work["data"], device_map="sequential", max_memory="cpu=100KB"))
    assert not report.clean
    assert any(p.kind == "not checked" and "could not run" in p.message for p in report.errors)
    quiet = check_dataset(
        CheckOptions(path=work["data"])
    )  # nothing asked beyond the recorded target, which loads: clean
    assert quiet.clean


KILLED_AT = textwrap.dedent("""
    import os, signal, sys
    from eaglet.cli import main
    n, calls = int(sys.argv[1]), [0]
    for name in ("replace", "rename"):  # every atomic write ends in one of them
        real = getattr(os, name)
        def killing(src, dst, *a, _real=real, **k):
            calls[0] += 1
            if calls[0] == n:  # the temp file is complete, its rename not done: the worst moment
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(src, dst, *a, **k)
        setattr(os, name, killing)
    sys.exit(main(sys.argv[2:]))
""")


def killed_at(n: int, args: list[str]) -> None:
    """Run `eaglet ARGS`, SIGKILLed at its n-th atomic rename."""
    proc = subprocess.run([sys.executable, "-c", KILLED_AT, str(n), *args], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("n", [1, 3, 6])
def test_convert_killed_at_any_write_resumes_to_the_same_files(n, work, tiny_target, tmp_path):
    args = ["convert", str(work["data"]), "--layout", "compact", "--target", str(tiny_target)]
    killed_at(n, [*args, "--out", str(tmp_path / "killed")])
    assert (
        subprocess.run(
            [sys.executable, "-m", "eaglet.cli", *args, "--out", str(tmp_path / "killed")], capture_output=True
        ).returncode
        == 0
    )
    convert(
        ConvertOptions(src=work["data"], out=tmp_path / "whole", layout="compact", target=str(tiny_target)),
        show_progress=False,
    )
    whole, killed = tree(tmp_path / "whole"), tree(tmp_path / "killed")
    assert set(killed) == set(whole), set(killed) ^ set(whole)
    assert [k for k in whole if k != "data_config.json" and killed[k] != whole[k]] == []


@pytest.mark.parametrize("n", [3, 6])  # the first write is the run folder's marker, the second train_config.json
def test_train_killed_at_any_write_resumes_exactly(n, work, tmp_path):
    opts = [
        "--total-steps",
        "8",
        "--ttt-steps",
        "3",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "2",
        "--eval-every",
        "4",
        "--save-every",
        "2",
        "--log-every",
        "2",
        "--batch-size",
        "2",
        "--eval-fraction",
        "0.1",
    ]
    killed_at(n, ["train", str(work["data"]), "--out", str(tmp_path / "killed"), *opts])
    assert (
        subprocess.run(
            [
                sys.executable,
                "-m",
                "eaglet.cli",
                "train",
                str(work["data"]),
                "--out",
                str(tmp_path / "killed"),
                "--resume",
            ],
            capture_output=True,
        ).returncode
        == 0
    )
    train(
        TrainOptions(dataset_dir=work["data"], out_dir=tmp_path / "whole", total_steps=8, **{**FAST, "save_every": 2}),
        show_progress=False,
    )
    step = "checkpoints/step_00000008/model.safetensors"
    assert (tmp_path / "killed" / step).read_bytes() == (tmp_path / "whole" / step).read_bytes()


def test_a_cut_off_torch_file_is_named(work, tmp_path):
    """A token_freq.pt cut short (a copy interrupted): torch's zip reader says nothing of the file."""
    data = tmp_path / "data"
    shutil.copytree(work["data"], data)
    freq = data / "token_freq.pt"
    freq.write_bytes(freq.read_bytes()[:100])
    with pytest.raises(
        ValueError,
        match=rf"^{freq}: not a readable torch file \(cut off or damaged: .*central "
        r"directory.*\); restore it or write it again$",
    ):
        train(TrainOptions(dataset_dir=data, out_dir=tmp_path / "run", total_steps=1, **FAST), show_progress=False)


def test_the_sweep_removes_safetensors_own_temp_files(tmp_path):
    """safetensors writes through a `.tmpXXXXXX` file of its own: a kill while a writer thread was in
    it (another thread renaming) left one in a convert's output, beside the files a rerun completes."""
    rows = tmp_path / "compact" / "rows_0-2000"
    rows.mkdir(parents=True)
    for name in (".tmpYRBhk3", "data_0.safetensors", "notes.tmp", ".tmpfolder-of-mine"):
        (rows / name).write_text("x")
    assert formats.remove_stale_temp_files(tmp_path) == 1
    assert sorted(p.name for p in rows.iterdir()) == [".tmpfolder-of-mine", "data_0.safetensors", "notes.tmp"]
