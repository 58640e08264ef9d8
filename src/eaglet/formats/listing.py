"""Listing a dataset folder's sample files without trusting their names: each layout's lister
(formats/layouts.py) is made of these, and reports files that break its layout (misplaced,
stray, broken or unfollowed links) instead of skipping them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eaglet.formats.samples import V1_FOLDER_RE

if TYPE_CHECKING:  # the registry imports this module: Layout is only named here
    from eaglet.formats.layouts import Layout


@dataclass
class DatasetFiles:
    """The hidden-state files of a dataset folder, listed without trusting their names."""

    files: list[tuple[int, Path]] = field(default_factory=list)  # (index, path); an index may repeat
    misplaced: list[tuple[int, Path, str]] = field(default_factory=list)  # (index, path, why): breaks the layout
    stray: list[Path] = field(default_factory=list)  # files of no layout (temp files of a killed writer, ...)
    broken_links: list[tuple[Path, str]] = field(default_factory=list)  # (path, why): links that lead nowhere
    unfollowed_links: list[tuple[Path, str]] = field(default_factory=list)  # (path, why): links to folders
    layout: Layout | None = None  # the layout found (`list_dataset_files` sets it), None when none was

    @property
    def format(self) -> str | None:
        """The layout's name (a FORMAT_*, as data_config.json records it), None when no layout was found."""
        return self.layout.name if self.layout is not None else None


def broken_link_problem(path: Path) -> str | None:
    """Why `path` is a symbolic link that leads nowhere (missing target, or a loop), else None."""
    if not path.is_symlink():
        return None
    try:
        path.resolve(strict=True)
    except FileNotFoundError:
        return f"symbolic link to {os.readlink(path)!r}, which does not exist"
    except (RuntimeError, OSError):  # RuntimeError up to Python 3.12, OSError(ELOOP) after
        return f"symbolic link that loops ({os.readlink(path)!r})"
    return None


def files_in(folder: Path, out: DatasetFiles, recursive: bool) -> list[Path]:
    """Regular files (and links to files) in `folder`, recording the links it cannot take in `out`.

    rglob does not descend into linked folders, so below the top such a link is reported, not silently skipped."""
    found = []
    for p in sorted(folder.rglob("*") if recursive else folder.iterdir()):
        why = broken_link_problem(p)
        if why:
            out.broken_links.append((p, why))
        elif p.is_file():
            found.append(p)
        elif p.exists() and not p.is_dir():  # a pipe, socket or device: never opened (a pipe blocks)
            out.broken_links.append((p, "a pipe, socket or device, not a file"))
        elif recursive and p.is_symlink():
            out.unfollowed_links.append(
                (
                    p,
                    f"symbolic link to the folder {os.readlink(p)!r}, not followed "
                    "(it could loop or count files twice)",
                )
            )
    return found


def rows_folder_problem(index: int, folder: str, rows_per_folder: int) -> str | None:
    """Why sample `index` does not belong in the folder named `folder` (None: it does)."""
    m = V1_FOLDER_RE.match(folder)
    if not m:
        return f"folder {folder!r} is not named rows_{{a}}-{{b}}"
    a, b = int(m.group(1)), int(m.group(2))
    if not a <= index < b:
        return f"index {index} lies outside its folder {folder}"
    if b - a != rows_per_folder or a % rows_per_folder:
        return (
            f"folder {folder} does not follow rows_{{k}}-{{k+{rows_per_folder}}} with k a multiple of {rows_per_folder}"
        )
    return None


def scan_rows_folders(root: Path, name_re: re.Pattern, rows_per_folder: int, out: DatasetFiles) -> None:
    """Files `rows_*/NAME` under `root`, each with what breaks the layout about where it is."""
    for entry in sorted(root.iterdir()):
        if entry.is_dir():  # a rows folder may be a link to one elsewhere (broken links are not dirs)
            for f in files_in(entry, out, recursive=True):
                m = name_re.match(f.name)
                if not m:
                    out.stray.append(f)
                    continue
                index = int(m.group(1))
                why = (
                    rows_folder_problem(index, entry.name, rows_per_folder)
                    if f.parent == entry
                    else f"nested below {entry.name}"
                )
                if why:
                    out.misplaced.append((index, f, why))
                out.files.append((index, f))


def rows_layout_files(folder: Path, name_re: re.Pattern, rows_per_folder: int) -> DatasetFiles:
    """The files of a `rows_{a}-{b}/NAME` layout under `folder` (v1, compact); a sample file
    directly in `folder` is listed, and reported as misplaced."""
    out = DatasetFiles()
    scan_rows_folders(folder, name_re, rows_per_folder, out)
    for f in files_in(folder, out, recursive=False):
        m = name_re.match(f.name)
        if m:
            out.files.append((int(m.group(1)), f))
            out.misplaced.append((int(m.group(1)), f, "not inside a rows_{a}-{b} folder"))
        else:
            out.stray.append(f)
    return out


def flat_layout_files(root: Path, name_re: re.Pattern) -> DatasetFiles | None:
    """The files named `name_re` directly in `root` (a broken link of that name counts), None when
    there is none: then the folder is not in this flat layout."""
    out = DatasetFiles()
    top = files_in(root, out, recursive=False)
    if not any(name_re.match(p.name) for p, _ in out.broken_links) and not any(name_re.match(p.name) for p in top):
        return None
    return DatasetFiles(
        [(int(m.group(1)), p) for p in top if (m := name_re.match(p.name))], broken_links=out.broken_links
    )


def nested_layout_files(root: Path, name_re: re.Pattern, rows_per_folder: int) -> DatasetFiles | None:
    """Files named `name_re` anywhere below `root`, flat or in rows folders (SpecForge writes both),
    None when there is none."""
    out = DatasetFiles()
    for p in files_in(root, out, recursive=True):
        m = name_re.match(p.name)
        if not m:
            continue
        index = int(m.group(1))
        out.files.append((index, p))
        if p.parent != root:  # flat SpecForge folders exist too; rows folders must be right
            rel = p.parent.relative_to(root)
            why = (
                rows_folder_problem(index, p.parent.name, rows_per_folder)
                if len(rel.parts) == 1
                else f"nested below {rel.parts[0]}"
            )
            if why:
                out.misplaced.append((index, p, why))
    return out if out.files else None
