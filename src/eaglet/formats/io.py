"""How eaglet writes and reads any file: atomically, naming the file when it fails, and never
running code stored in one.

Every write is atomic (temp file in the same folder, then `os.replace`), so a reader sees a
complete file or none, whatever moment a writer is killed at; the temp files a killed writer
leaves carry TMP_MARK in their name, and `remove_stale_temp_files` clears them. `.pt` / `.bin`
files load with torch's weights-only unpickler, safetensors files hold raw tensors only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import glob
import io
import json
import logging
import os
import pickle
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"  # every temp file eaglet writes has this in its name
# safetensors (>= 0.6) writes a file through a temp file of its own beside it, `.tmp` + 6 characters,
# inside eaglet's: a kill during it (a writer thread's, as another thread renames) leaves one
SAFETENSORS_TMP_RE = re.compile(r"\.tmp[A-Za-z0-9]{6}")


# ---------------------------------------------------------------------------------------------
# Failed writes, said in one line
# ---------------------------------------------------------------------------------------------


class WriteFailed(OSError):
    """A write that failed, said in one line that names the file, why, and what to do."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


# what to do about a file that a copy or download cut short
REDO = "download or copy it again (a download or copy that stopped early, or a disk fault, leaves a file like this)"

# Below this much free space a failed write is taken to be a full disk: torch.save reports one as
# "[enforce fail at inline_container.cc] unexpected pos", with neither errno nor file name.
LOW_SPACE_BYTES = 64 << 20
WRITE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EIO,
    errno.ENOTDIR,
    errno.EEXIST,
}


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def disk_nearly_full(folder: Path) -> bool:
    free = free_bytes(folder)
    return free is not None and free < LOW_SPACE_BYTES


# safetensors (Rust) reports an OS error in its message only: "... (os error 28)" or "Os { code: 28, ..."
RUST_OS_ERROR = re.compile(r"os error (\d+)|Os \{ code: (\d+)")


def error_code(error: BaseException) -> int | None:
    """The errno of a failed file operation, from Python's OSError or from safetensors' message."""
    code = getattr(error, "errno", None)
    if code is None and isinstance(error, SafetensorError):
        found = RUST_OS_ERROR.search(str(error))
        code = int(found.group(1) or found.group(2)) if found else None
    return code


def blocked_path(path: Path) -> str | None:
    """Why nothing can be created at `path`, when one of it and its parents is a symbolic link to
    nothing, or one of its parents a file: creating through it fails with a bare "File exists"
    or "Not a directory"."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            return (
                f"{p} is a symbolic link to {os.readlink(p)}, which does not exist; create what it points to, "
                "remove the link, or choose another path"
            )
        if p != path and p.exists() and not p.is_dir():
            return f"{p} is a file, not a folder; choose another path"
    return None


def refuse_blocked_path(path: str | os.PathLike, option: str = "--out") -> None:
    """Before a stage writes anything: an output path through a dangling link, or under a file, is
    refused, saying so."""
    reason = blocked_path(Path(path))
    if reason is not None:
        raise FileExistsError(f"{option} {path}: {reason}")


def os_error_reason(error: BaseException, path: Path) -> str:
    """Why a file operation on `path` failed, with the recovery step for the kinds a user can fix."""
    folder = path.parent if path.parent.exists() else Path.cwd()  # where free space is measured
    code = error_code(error)
    blocked = blocked_path(path) if code in (errno.EEXIST, errno.ENOTDIR, errno.ENOENT) else None
    if blocked is not None:
        return blocked
    # a known errno is the cause (a pseudo-filesystem such as /proc also reports no free space)
    if code == errno.ENOSPC or (code is None and disk_nearly_full(folder)):
        return (
            f"no space left on the device ({(free_bytes(folder) or 0) >> 20} MiB free); free some space and "
            "run the same command again: finished files are kept and the stage resumes where it stopped"
        )
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{os.strerror(code).lower()}; use another folder (--out) or fix its permissions"
    return getattr(error, "strerror", None) or str(error)


def write_failure(path: Path, error: BaseException) -> WriteFailed:
    """A failed write of `path` as one line: the file, why, what to do (every eaglet stage resumes)."""
    code = error_code(error) or errno.EIO
    return WriteFailed(code, f"could not write {path}: {os_error_reason(error, path)}")


@contextlib.contextmanager
def failures_named(path: Path) -> Iterator[None]:
    """Turn a failed write inside the block into a WriteFailed naming `path` (other errors pass)."""
    try:
        yield
    except WriteFailed:
        raise
    except (OSError, RuntimeError, SafetensorError) as e:
        # Only what a write can fail with: the block may also read (prepare streams its input
        # inside one), and a missing input file is not a failed write.
        if error_code(e) in WRITE_ERRNOS or disk_nearly_full(path.parent):
            raise write_failure(path, e) from e
        raise


# ---------------------------------------------------------------------------------------------
# One writer per output
# ---------------------------------------------------------------------------------------------

WRITING = "is writing it; wait for it to end, or write to another --out"


class OutputBusy(RuntimeError):
    """Another eaglet process holds the lock of the output this one would write."""


def lock_path(out: str | os.PathLike, part: str = "") -> Path:
    """The lock file of an output, beside it (`.NAME.lock`): outside the output, so a stage that
    replaces its output folder, or writes it by rename, never removes a lock another process holds.
    `part` names one share of an output written side by side (an extract shard). Beside the real
    path: an output reached through a symbolic link has the same lock as by its own name."""
    out = Path(os.path.realpath(out))
    return out.parent / f".{out.name}{'.' + part if part else ''}.lock"


def refuse_odd_lock(lock: Path) -> None:
    """A lock path that is a folder or a symbolic link (dangling or not) is not eaglet's: say so."""
    if lock.is_symlink():
        raise OSError(
            errno.ELOOP,
            f"{lock}: a symbolic link (to {os.readlink(lock)}), not eaglet's lock file; "
            "remove it (eaglet creates the lock file itself)",
        )
    if lock.exists() and not lock.is_file():
        raise OSError(
            errno.EISDIR,
            f"{lock}: a {'folder' if lock.is_dir() else 'special file'}, not eaglet's lock "
            "file; remove it (eaglet creates the lock file itself)",
        )


def held_lock(lock: Path) -> int | None:
    """An open descriptor of `lock` holding its exclusive flock, or None when another process holds
    it. The file may be unlinked by its holder as it releases it (below): a lock taken on a file no
    longer at `lock` is no lock, so it is taken again on the file that is there now."""
    while True:
        with failures_named(lock):
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def lock_is_held(lock: Path) -> bool:
    """Whether another process holds `lock` now (probed without taking it for long)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def refuse_other_sharding(out: str | os.PathLike, num_shards: int) -> None:
    """Shards of another --num-shards writing the same folder now would split the samples another
    way and write some twice at once: refused, naming the lock of the run that holds them."""
    out = Path(os.path.realpath(out))
    for lock in out.parent.glob(f".{glob.escape(out.name)}.shard-*-of-*.lock"):
        count = lock.name.rsplit("-of-", 1)[1].removesuffix(".lock")
        if count != str(num_shards) and lock_is_held(lock):
            raise OutputBusy(
                f"{out}: an `eaglet extract` with --num-shards {count} is writing it now ({lock}); this "
                f"one splits the samples into {num_shards}: wait for it, or use the same --num-shards"
            )


SHARD_LOCK = ".shard-*-of-*.lock"  # after `.NAME`: an extract shard's lock (`lock_path(out, part)`)


def holder_of(lock: Path) -> str:
    """Who holds `lock`, as its holder wrote it."""
    try:
        holder = lock.read_text(encoding="utf-8", errors="replace").strip().split("\n")
    except OSError:
        holder = []
    return f"`eaglet {holder[0]}` ({holder[1]})" if len(holder) == 2 else "eaglet process"


def refuse_other_writers(out: Path, lock: Path, busy: str) -> None:
    """A stage holding the other kind of lock of the same output (`convert`'s whole-output lock, an
    `extract` shard's lock) would write it at once and clean up the other's temp files: refused,
    naming the holder. Shards of one extraction write side by side (`refuse_other_sharding`)."""
    name = Path(os.path.realpath(out)).name
    whole = lock.parent / f".{name}.lock"
    others = [whole] if lock != whole else sorted(lock.parent.glob(f".{glob.escape(name)}{SHARD_LOCK}"))
    for other in others:
        if lock_is_held(other):
            raise OutputBusy(f"{out}: another {holder_of(other)} {busy} ({other.name})")


@contextlib.contextmanager
def output_lock(out: str | os.PathLike, stage: str, busy: str = WRITING, lock: Path | None = None) -> Iterator[None]:
    """Hold an exclusive flock on `out`'s lock file (`lock_path(out)` unless given) for the block: one
    writer per output. The kernel drops it when the holder ends, however it ends, so a killed writer
    never leaves it stuck (a lock file that merely exists would); a writer that ends normally removes
    the file. It records its holder for the next one's message, which ends with `busy`, e.g. "is
    writing this run folder; wait for it to end, or train into another --out"."""
    refuse_blocked_path(out)
    refuse_inside_dataset(Path(out), stage)  # before the lock's folder is made
    lock = lock or lock_path(out)
    refuse_odd_lock(lock)
    out, ours = Path(out), {OUTPUT_MARKER, lock.name}  # as it was before this run (the lock may live inside)
    existed, before, marked_before = out.is_dir(), entries(out) - ours, (out / OUTPUT_MARKER).exists()
    fd = held_lock(lock)
    if fd is None:
        raise OutputBusy(f"{out}: another {holder_of(lock)} {busy}")
    with os.fdopen(fd, "r+", encoding="utf-8") as f:
        with failures_named(lock):  # a full disk fails here first: named, with what to do
            f.truncate()
            f.write(f"{stage}\npid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        claimed = False
        try:
            refuse_other_writers(out, lock, busy)
            claim_output(out, stage)
            claimed = True
            if marked(stage):  # marked before the first write: a killed run's folder is its rerun's
                make_output(out, stage)
            yield
        finally:
            lock.unlink(missing_ok=True)  # while still held: see held_lock
            if claimed and marked(stage) and not marked_before and entries(out) - ours == before:
                unmake_output(out, existed)  # refused before writing: the folder is left as it was


def unmake_output(out: Path, existed: bool) -> None:
    """Undo `make_output` for a run that wrote nothing: its marker, and the folder if it made it."""
    with contextlib.suppress(OSError):
        (out / OUTPUT_MARKER).unlink(missing_ok=True)
        if not existed:
            out.rmdir()


def inside_folder(folder: str | os.PathLike, relative: str, where: str, follow_links: bool = True) -> Path:
    """`folder / relative` for a path read from a file (a weight index's shard, a recipe's folder):
    refused unless it is a plain relative path that stays inside `folder`, links resolved, so a
    file can never lead eaglet to read or write elsewhere. `follow_links` False: the path itself
    must stay inside, whatever its links lead to (a Hugging Face cache snapshot links every file to
    the cache's blobs: the folder's owner made those links, the index only names them)."""
    folder = Path(folder)
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute():
        raise ValueError(f"{where}: {relative!r} is not a path relative to {folder}")
    path = folder / relative
    base = os.path.realpath(folder) if follow_links else os.path.normpath(os.path.abspath(folder))
    named = os.path.realpath(path) if follow_links else os.path.normpath(os.path.abspath(path))
    if os.path.commonpath([base, named]) != base:
        raise ValueError(f"{where}: {relative!r} leads out of {folder}; it must name a file inside that folder")
    return path


def read_weight_index(path: str | os.PathLike) -> dict[str, str]:
    """A Hugging Face weight index's `weight_map` (tensor name -> shard file), its form checked:
    the shards are then resolved with `inside_folder`."""
    index = read_json(path)
    names = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise ValueError(
            f'{path}: no "weight_map" object of tensor name -> shard file; the index is damaged: '
            "download or write the folder again"
        )
    return names


# ---------------------------------------------------------------------------------------------
# Which stage an output folder belongs to
# ---------------------------------------------------------------------------------------------

# The kind of folder each stage writes (stages of one kind may share a folder: extract's shards,
# convert into an extract's dataset, which data_config.json then checks). regen writes one file.
OUTPUT_KINDS = {
    "prepare": "prepared dataset",
    "extract": "hidden-state dataset",
    "convert": "hidden-state dataset",
    "train": "train run",
    "eval": "eval results",
    "run": "recipe run",
    "export": "drafter",
    "import": "drafter",
}
# The files that say which kind a folder is: written by the stage (the marker, from now on), or
# its own files (folders written before the marker).
OUTPUT_MARKER = ".eaglet-output"
KIND_FILES = {
    "prepared dataset": ("prepared.jsonl", "prepare_config.json"),
    "hidden-state dataset": ("data_config.json", "hidden_states"),
    "train run": ("train_config.json", "checkpoints", "metrics.jsonl"),
    "eval results": ("eval.json",),
    "recipe run": ("stages",),
    "drafter": ("config.json", "model.safetensors"),
}
# Every name a stage of each kind writes at the top of its folder (glob patterns): in a folder no
# eaglet stage marked, one of these is someone else's file that the stage would replace or adopt
# (a speculators dataset's Arrow table, a tool's own train_config.json), so it is refused.
WRITTEN_NAMES = {
    "prepared dataset": ("prepared.jsonl", "prepare_config.json", "token_freq.pt"),
    "hidden-state dataset": (
        "data_config.json",
        "hidden_states",
        "signatures",
        "sample_lengths.json",
        "token_freq.pt",
        "rows_*",
        "compact",
        "state.json",
        "dataset_info.json",
        "data-*.arrow",
    ),
    "train run": ("train_config.json", "checkpoints", "metrics.jsonl", "tensorboard"),
    "eval results": ("eval.json", "eval.png", "vllm-drafter", "vllm-logs", "drafter.gguf", "llama-server-logs"),
    "recipe run": ("stages", "summary.json", "regen", "prepared", "data", "train", "eval"),
}
# stages whose output is not a folder of their own kind: the file a stage writes (regen's JSONL,
# export's GGUF) and drafter folders, which appear whole by rename and are refused when not empty
UNMARKED = ("regen", "export", "import")


def claim_output(out: str | os.PathLike, stage: str) -> None:
    """Before a stage writes anything into `out`: refuse a path that is a file where the stage
    writes a folder, a folder that holds another kind of output (its marker, or that kind's own
    files, named), and one no stage marked that holds files of the names this stage writes."""
    refuse_blocked_path(out)
    out = Path(out)
    refuse_inside_dataset(out, stage)  # output_lock refused it first: here for a caller without the lock
    if not marked(stage):
        return
    kind = OUTPUT_KINDS[stage]
    if out.exists() and not out.is_dir():
        raise FileExistsError(
            f"--out {out}: an existing file; `eaglet {stage}` writes a folder ({kind}): give a "
            f"folder path that does not exist yet, or an empty one"
        )
    if out.is_dir():
        refuse_other_kind(out, stage, kind)


def refuse_overlap(
    out: str | os.PathLike, stage: str, inputs: dict[str, str | os.PathLike | None], inside_ok: bool = False
) -> None:
    """Before a stage writes anything: an output that is one of its inputs, holds one or lies inside
    one is refused (each stage writes a folder of its own; a write there could replace the input,
    as prepare did to a chat file named prepared.jsonl). `inputs`: how each is named -> path given.
    `inside_ok`: a new folder inside an input is allowed (a drafter exported into its run folder
    leaves everything there as it was)."""
    o = Path(os.path.realpath(out))
    for name, given in inputs.items():
        if given is None or not os.path.exists(given):  # a name (the embedded data) or nothing yet
            continue
        i = Path(os.path.realpath(given))
        where = (
            "is" if o == i else "holds" if o in i.parents else "is inside" if i in o.parents and not inside_ok else None
        )
        if where is not None:
            raise FileExistsError(
                f"{out_named(stage)} {out} {where} {name} {given}: `eaglet {stage}` writes a folder of its own, "
                f"apart from its inputs; nothing was written: choose another {out_named(stage)}"
            )


DATASET_KINDS = ("prepared dataset", "hidden-state dataset")


RUN_OWN_FOLDERS = ("checkpoints",)  # a train run's folders that hold its own files only
OUT_ARGUMENT = {"export": "OUT"}  # how a stage's command line names its output, where not --out


def out_named(stage: str) -> str:
    return OUT_ARGUMENT.get(stage, "--out")


def folder_kind(folder: Path) -> str | None:
    """The kind of output `folder` holds: its marker's, or, for a folder written before markers
    (or whose marker was removed), the dataset or run its own files make it."""
    marker = folder / OUTPUT_MARKER
    if marker.is_file() and not marker.is_symlink():
        return marker.read_text(encoding="utf-8", errors="replace").strip()
    for kind in (*DATASET_KINDS, OUTPUT_KINDS["train"]):
        if all(os.path.lexists(folder / name) for name in KIND_FILES[kind][:2]):
            return kind
    return None


def refuse_inside_dataset(out: Path, stage: str) -> None:
    """An output inside a dataset a stage made, or inside a train run's checkpoints: its files
    would be the dataset's stray files, which `eaglet check` refuses (and train with it), be taken
    for its samples, or sit among the checkpoints a run prunes and resumes from."""
    path = Path(os.path.realpath(out))
    for folder in path.parents:
        kind = folder_kind(folder)
        if kind is not None:
            inside = path.relative_to(folder).parts[0]
            if kind in DATASET_KINDS or (kind == OUTPUT_KINDS["train"] and inside in RUN_OWN_FOLDERS):
                where = f"the {kind} {folder}" + (f" (its {inside}/)" if kind not in DATASET_KINDS else "")
                raise FileExistsError(
                    f"{out_named(stage)} {out}: inside {where}, whose folder holds its own files only; "
                    f"`eaglet {stage}` wrote nothing: choose an {out_named(stage)} outside it"
                )


def marked(stage: str) -> bool:
    """Whether `stage` writes a folder of its own kind, marked as such."""
    return stage in OUTPUT_KINDS and stage not in UNMARKED


def mark_output(out: str | os.PathLike, stage: str) -> None:
    """Mark a stage's output folder as its kind of output (once)."""
    marker = Path(out) / OUTPUT_MARKER
    if marked(stage) and Path(out).is_dir() and not marker.exists():
        with contextlib.suppress(OSError):  # a marker that cannot be written (full disk) leaves the output as it is
            write_text_atomic(marker, f"{OUTPUT_KINDS[stage]}\n")


def make_output(out: str | os.PathLike, stage: str) -> Path:
    """Create a stage's output folder (claimed first) marked as its kind from the start, so a run
    killed before it ends leaves a folder its rerun knows as its own."""
    out = Path(out)
    with failures_named(out):
        out.mkdir(parents=True, exist_ok=True)
    mark_output(out, stage)
    return out


def entries(folder: Path) -> set[str]:
    """The names in `folder` (none when it is no folder)."""
    return set(os.listdir(folder)) if folder.is_dir() else set()


def present_names(out: Path, patterns: tuple[str, ...]) -> list[str]:
    """The entries of `out` (links too, dangling or not) that match `patterns`, sorted."""
    return sorted(n for n in entries(out) if any(fnmatch.fnmatchcase(n, pattern) for pattern in patterns))


def refuse_other_kind(out: Path, stage: str, kind: str) -> None:
    marker = out / OUTPUT_MARKER
    if marker.is_symlink() or (marker.exists() and not marker.is_file()):
        raise FileExistsError(
            f"--out {out}: {OUTPUT_MARKER} is not eaglet's marker file (a folder or a link); "
            "nothing was written: remove it, or choose another --out"
        )
    recorded = marker.read_text(encoding="utf-8", errors="replace").strip() if marker.is_file() else kind
    own = WRITTEN_NAMES.get(kind, ())
    # another kind's own files count whatever the marker says: a marker copied in says nothing of them
    found = [f"{OUTPUT_MARKER} says {recorded!r}"] if recorded != kind else []
    found += [
        name
        for other, names in KIND_FILES.items()
        if other != kind
        for name in names
        if os.path.lexists(out / name) and not any(fnmatch.fnmatchcase(name, p) for p in own)
    ]
    if found:
        raise FileExistsError(
            f"--out {out}: holds another stage's output ({', '.join(found)}), and `eaglet {stage}` "
            f"writes its own ({kind}): nothing was written; choose another --out (each stage writes a "
            f"folder of its own)"
        )
    written = present_names(out, WRITTEN_NAMES.get(kind, ()))
    linked = [n for n in written if (out / n).is_symlink()]
    if linked:
        name = linked[0]
        raise FileExistsError(
            f"{out / name}: a symbolic link (to {os.readlink(out / name)}) where `eaglet {stage}` "
            f"writes its own {name}; eaglet writes inside its output folder only: nothing was "
            "written; remove the link, or choose another --out"
        )
    unowned = [] if marker.is_file() else written
    if unowned:
        raise FileExistsError(
            f"--out {out}: holds {', '.join(unowned)}, which no eaglet stage marked as its own (no "
            f"{OUTPUT_MARKER}): `eaglet {stage}` would replace or adopt them; nothing was written: "
            "choose another --out, or move those files away"
        )


# ---------------------------------------------------------------------------------------------
# Atomic writes: files and folders
# ---------------------------------------------------------------------------------------------


def current_umask() -> int:
    """The process's umask (read by setting it, and setting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success rename it onto `path`, else delete it.

    A failed write (full disk, read-only folder) is a WriteFailed naming `path`."""
    path = Path(path)
    with failures_named(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        try:
            yield tmp_path
            if fsync:
                with open(tmp_path, "rb+") as f:
                    os.fsync(f.fileno())
            os.chmod(tmp_path, 0o666 & ~current_umask())  # mkstemp makes 0600; a file written plainly honours the umask
            os.replace(tmp_path, path)
        finally:
            tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside `final`; on success fsync its files and rename it onto `final`
    (which may not exist yet, or be empty), else delete it: a folder that exists is complete."""
    final = Path(final)
    refuse_blocked_path(final)
    if final.is_symlink():  # the rename would replace the link, not fill the folder it names
        raise FileExistsError(f"{final}: a symbolic link (to {os.readlink(final)}); give the folder's own path")
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        held = sorted(os.listdir(final)) if final.is_dir() else []
        what = (
            f"a folder that is not empty ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
            if held
            else "a file"
        )
        raise ValueError(
            f"{final}: {what}; eaglet writes this output as a new folder and wrote nothing: choose another "
            "folder (an empty one, or one that does not exist yet)"
        )
    with failures_named(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP_MARK}", dir=final.parent))
        try:
            yield tmp
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():
                final.rmdir()
            os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; a folder made plainly honours the umask
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temp_files(folder: str | os.PathLike, owned: set[str] | None = None, recursive: bool = True) -> int:
    """Delete temp files and folders (atomic_dir's) a killed writer left behind; `owned` limits it to
    these final names, `recursive=False` to `folder` itself (its other folders may be a user's). A
    folder that does not exist (yet) has none."""

    def stale(name: str) -> bool:
        ours = name.startswith(".") and TMP_MARK in name and (owned is None or name[1:].split(TMP_MARK, 1)[0] in owned)
        return ours or SAFETENSORS_TMP_RE.fullmatch(name) is not None

    removed = 0
    for root, dirs, files in os.walk(os.fspath(folder)):
        for name in [d for d in dirs if stale(d)]:
            shutil.rmtree(Path(root, name), ignore_errors=True)
            dirs.remove(name)
            removed += 1
        for name in filter(stale, files):
            Path(root, name).unlink(missing_ok=True)
            removed += 1
        if not recursive:
            break
    return removed


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def refuse_non_file(path: str | os.PathLike, what: str) -> None:
    """A folder, pipe or device where eaglet reads a file is named (a FIFO would block the read
    forever, a folder fail with a bare errno); a missing file is left to the reader's own error."""
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(
            errno.EISDIR, f"{path}: a folder where eaglet expects {what}; remove or rename it", str(path)
        )
    if p.exists() and not p.is_file():
        raise ValueError(f"{path}: a pipe or device where eaglet expects {what}; remove or rename it")


def read_json(path: str | os.PathLike) -> Any:
    """The parsed file; a malformed one is a ValueError that names it (and line/column), a folder
    or pipe where the file should be one that says so."""
    refuse_non_file(path, "a JSON file")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise ValueError(f"{path}: not valid JSON ({e}); the file is damaged or cut off") from e


# ---------------------------------------------------------------------------------------------
# torch files, loaded without running pickled code
# ---------------------------------------------------------------------------------------------


def read_jsonl_log(path: str | os.PathLike) -> list[Any]:
    """The records of an append-only JSON-lines log (one write per line). A last line without its
    newline is what a kill mid-write leaves: dropped, with a warning. Any other line that is not
    JSON is damage nobody explains: an error naming the file and line."""
    path = Path(path)
    refuse_non_file(path, "a JSON-lines log")
    records = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                log.warning("%s: dropping a partial last line (%d bytes; a killed run was writing it)", path, len(line))
                break
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except (ValueError, RecursionError) as e:
                raise ValueError(
                    f"{path}:{n}: not a JSON line ({e}); the file is damaged: restore it or remove the line"
                ) from None
    return records


def torch_save_atomic(obj: Any, path: str | os.PathLike, fsync: bool = True) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        torch.save(obj, tmp)


# What torch's weights-only unpickler says when a file asks for an object outside its allow-list
# (a class, a function to call); garbage bytes fail the same loader with "Unsupported operand".
PICKLED_CODE_MARKERS = (
    "Unsupported global",
    "unsupported GLOBAL",
    "Can only create new object",
    "Can only build Tensor",
)


class TorchFileRefused(pickle.UnpicklingError, ValueError):
    """A `.pt` / `.bin` file the weights-only loader refused, said in one line that names the file.

    Still an UnpicklingError, so callers that classify torch's own error keep working; a
    ValueError, so the command line prints it as the one line it is."""


def weights_only_detail(message: str) -> str:
    """The weights-only unpickler's own diagnosis in torch's message, without the advice around it
    (torch suggests weights_only=False or allow-listing the class: running the file's code)."""
    if "WeightsUnpickler error:" not in message:
        return "refused by the weights-only loader"
    detail = message.split("WeightsUnpickler error:", 1)[1].strip().splitlines() or [""]
    return detail[0].split(". Please", 1)[0].strip().rstrip(".")


def weights_only_refusal(where: str, e: pickle.UnpicklingError) -> TorchFileRefused:
    """The weights-only loader's refusal of the file(s) `where`, in one line without torch's advice
    to turn weights_only off."""
    text, detail = str(e), weights_only_detail(str(e))
    if any(m in text for m in PICKLED_CODE_MARKERS):
        return TorchFileRefused(
            f"{where}: holds Python objects beyond tensors ({detail}), which eaglet will not execute (it loads "
            ".pt/.bin files with weights_only=True); in an environment you trust, load it and re-save its "
            "tensors as safetensors, or torch.save them as a plain dict of tensors"
        )
    return TorchFileRefused(
        f"{where}: not a readable torch file ({detail}); it is damaged or was not written "
        "by torch.save: restore it or write it again"
    )


def torch_load_safe(path: str | os.PathLike) -> Any:
    """Load a `.pt` / `.bin` file without executing pickled code (the only way eaglet loads them).

    A file that needs more than tensors and plain containers is refused with what to do instead."""
    refuse_non_file(path, "a torch file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise
        raise weights_only_refusal(str(path), e) from e
    except RuntimeError as e:  # torch.save writes a zip: a cut-off one fails in its zip reader, naming no file
        if "PytorchStreamReader" not in str(e):
            raise
        raise TorchFileRefused(
            f"{path}: not a readable torch file (cut off or damaged: "
            f"{str(e).splitlines()[0][:160]}); restore it or write it again"
        ) from e


def torch_load_safe_mmap(path: str | os.PathLike) -> Any:
    """`torch_load_safe`, with tensors memory-mapped from the file instead of copied: a reader
    that looks at every byte once (eaglet check) skips an allocation and a copy per tensor.
    Still weights_only. Files in torch's legacy (non-zip) format cannot be mapped: plain load."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e) and "zipfile" not in str(e):
            raise
        return torch_load_safe(path)


def torch_load_safe_bytes(data: bytes) -> Any:
    """`torch_load_safe` for an in-memory file (a decompressed `.ckpt.gz`); never runs pickled code."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------------------------------
# safetensors files
# ---------------------------------------------------------------------------------------------


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (raw tensors only: reading one never runs code); a
    truncated or damaged file is a ValueError that names it."""
    refuse_non_file(path, "a safetensors file")
    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or damaged ({e})") from e


def write_safetensors_atomic(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> Path:
    """`tensors` (contiguous) as one safetensors file at `path`, atomically."""
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def header_shapes(path: str | os.PathLike, keys: tuple[str, ...]) -> dict[str, list[int]]:
    """The shapes of these tensors of a safetensors file, from its header alone."""
    with safe_open(str(path), framework="pt") as h:
        return {k: h.get_slice(k).get_shape() for k in keys}
