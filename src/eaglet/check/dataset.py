"""`eaglet check DIR` over a whole dataset: every file is read (never a sample of them), and
the dataset's side files must agree with its files (data_config.json's totals, sample_lengths.json,
token_freq.pt), with no duplicate or missing index and the layout's folder naming; with a target,
the checks of eaglet.check.identity on sampled files and the loss mask against the chat template
on every file.

Entry point: `check_dataset(path, target=None, ...) -> CheckReport`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eaglet import formats, layers
from eaglet.check.files import Expect, FileResult, check_file, is_unsafe_pickle_error, load_problem
from eaglet.check.identity import (
    generation_prompt,
    heads_check,
    identity_check,
    load_target_for_check,
    pick_identity_files,
    target_revision_problem,
    template_mismatch,
    too_long_problems,
)
from eaglet.check.report import (
    BROKEN_LINK,
    DATA_CONFIG,
    DUPLICATE_INDEX,
    ERROR,
    FOLDER_NAMING,
    LAYER_IDENTITY,
    MASK_TEMPLATE,
    MISSING_INDEX,
    NO_FILES,
    NOT_CHECKED,
    RMS_BOUNDS,
    SAMPLE_LENGTHS,
    STATE_SIGNATURE,
    STRAY_FILE,
    TOKEN_FREQ,
    UNREADABLE,
    WARNING,
    CheckReport,
    Problem,
    SlotStats,
)
from eaglet.chat import special_token_ids
from eaglet.formats import fmt_rows
from eaglet.heads import TargetHeads
from eaglet.options import CheckOptions
from eaglet.placement import Placement, placement_from_options

# A file whose median row RMS in a slot is this far from the dataset's median for that slot is
# an outlier (a different layer or a different model). Median rows, not the plain RMS: the
# first token's "attention sink" row is hundreds of times larger than the rest, so the plain
# RMS of a short file is dominated by it and would flag every short file.
RMS_OUTLIER_FACTOR = 10.0


# ---------------------------------------------------------------------------------------------
# data_config.json and what it makes every file expected to be
# ---------------------------------------------------------------------------------------------


def read_config(root: Path, layout: formats.Layout) -> tuple[formats.DataConfig | None, list[Problem]]:
    path = root / formats.DATA_CONFIG_FILE
    if not path.exists():
        # eaglet's own layouts always have one; foreign layouts may not (then files set the bar).
        sev = ERROR if layout.side_files else WARNING
        return None, [
            Problem(
                DATA_CONFIG, formats.DATA_CONFIG_FILE, "missing: expectations are inferred from the first file", sev
            )
        ]
    try:
        raw = formats.read_json(path)
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    except Exception as e:
        return None, [Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"unreadable: {e}")]
    cfg, kind_problems = formats.parse_data_config(raw)
    probs = layer_ids_problems(raw)
    if isinstance(cfg.format, str) and formats.find_layout(cfg.format) is None:
        probs.append(
            Problem(
                DATA_CONFIG,
                formats.DATA_CONFIG_FILE,
                f"format {cfg.format!r} is no layout eaglet knows (the files are {layout.name})",
            )
        )
    version_problem = layout.config_problem(raw)
    if version_problem:
        probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, version_problem))
    version_warning = layout.config_warning(raw)
    if version_warning:
        probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, version_warning, WARNING))
    probs += [
        Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, why) for why in kind_problems if not why.startswith("layer_ids ")
    ]  # reported by layer_ids_problems, with EAGLE-3's rule
    return cfg, probs


def layer_ids_problems(cfg: dict[str, Any]) -> list[Problem]:
    """layer_ids: EAGLE-3's count of strictly increasing ints, ending at the target's last layer."""
    ids, n, aux = cfg.get("layer_ids"), cfg.get("num_hidden_layers"), cfg.get("aux_layer_ids")
    problem = layers.stored_ids_problem(ids, n if isinstance(n, int) else None)
    if problem:
        return [Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"layer_ids {ids!r}: {problem}")]
    if aux is not None and isinstance(ids, list) and aux != ids[:-1]:  # two records of one fact: which is right?
        return [
            Problem(
                DATA_CONFIG,
                formats.DATA_CONFIG_FILE,
                f"aux_layer_ids {aux!r} are not layer_ids {ids!r} without the last layer",
            )
        ]
    return []


def expect_from_config(cfg: formats.DataConfig, layout: formats.Layout) -> Expect:
    ids = cfg.layer_ids
    teacher = layout.stores_teacher  # its files hold the aux states and, in place of the last, a teacher
    return Expect(
        layout,
        cfg.hidden_size,
        len(ids) - teacher if ids is not None else None,
        None if layout.dequantized else cfg.hidden_states_dtype,
        cfg.vocab_size,
        teacher_top_k=layout.stored_top_k(cfg.to_json()),
        config=cfg.to_json(),
    )


def expect_from_file(first: FileResult, layout: formats.Layout, vocab_size: int | None) -> Expect:
    return Expect(
        layout,
        first.hidden_size,
        first.num_states,
        first.dtype,
        vocab_size,
        source=f"as in the first file, {first.path}",
    )


def expectations(
    root: Path, files: list[tuple[int, Path]], cfg: formats.DataConfig | None, layout: formats.Layout, vocab: int | None
) -> Expect:
    """From data_config.json; without one, the first readable file sets the bar for all others.
    With them, each file's state signatures as extraction recorded them."""
    if cfg is not None:
        exp = expect_from_config(cfg, layout)
    else:
        probe = Expect(layout, vocab_size=vocab)
        first = next((r for r in (check_file(i, p, root, probe) for i, p in files[:20]) if r.num_states), None)
        exp = expect_from_file(first, layout, vocab) if first else probe
    if not layout.dequantized:  # the compact layout's files carry checksums instead
        exp.signatures, unreadable = formats.read_signatures(root, cfg.signature_key if cfg else None)
        exp.problems += [Problem(STATE_SIGNATURE, where, why) for where, why in unreadable]
        exp.signatures_required = signatures_recorded(cfg, layout, root)
        exp.problems += signature_log_problems(cfg, exp.signatures, layout, exp.signatures_required)
    return exp


def signatures_recorded(cfg: formats.DataConfig | None, layout: formats.Layout, root: Path) -> bool:
    """Whether extraction kept every file's signature, so that a file without its line is damage:
    data_config.json records the log (either of its two fields: one deleted by hand leaves the
    other), or the log is there. With the log there, the config's `format` is not asked (an edited
    one would switch the check off); without it, files rewritten into another layout beside a
    copied config (a flat v1 folder, say) are a dataset that kept none."""
    if cfg is None or layout.dequantized:  # the compact layout's files carry checksums instead
        return False
    if (root / formats.SIGNATURES_DIR).exists():
        return True
    recorded = cfg.state_signatures is not None or cfg.signature_key is not None
    return recorded and cfg.format in (None, layout.name)


def signature_log_problems(
    cfg: formats.DataConfig | None, recorded: dict[int, Any] | None, layout: formats.Layout, kept: bool
) -> list[Problem]:
    """The log itself, where `kept` (`signatures_recorded`) says the dataset keeps one: without its
    key, gone (every file's state check would be switched off without a word), or naming samples
    the dataset has not; where it keeps none, a warning that the files' slots are judged by scale."""
    if cfg is None or layout.dequantized:
        return []
    where = formats.SIGNATURES_DIR
    if not kept:
        return [
            Problem(
                STATE_SIGNATURE,
                where,
                "none: this dataset records no signature log (another tool's, or an older eaglet's), so each "
                "file's slots are compared by their scale only, and a neighbouring layer's states or another "
                "dataset's file would pass: extract it again with this eaglet to have every file checked",
                WARNING,
            )
        ]
    if cfg.signature_key is None:
        return [
            Problem(
                STATE_SIGNATURE,
                formats.DATA_CONFIG_FILE,
                f"no signature_key, though this dataset keeps a signature log ({where}/): the key tells this "
                "extraction's lines from lines copied in from another dataset, so no line can vouch for its "
                "file: restore data_config.json, or extract again",
            )
        ]
    if recorded is None:
        return [
            Problem(
                STATE_SIGNATURE,
                where,
                f"missing: {formats.DATA_CONFIG_FILE} records that extraction kept every file's signature there, "
                "so no file's states can be checked against it: restore the folder, or extract again",
            )
        ]
    beyond = sorted(i for i in recorded if cfg.num_samples is not None and not 0 <= i < cfg.num_samples)
    if beyond:
        return [
            Problem(
                STATE_SIGNATURE,
                where,
                f"lines for sample(s) {fmt_rows(beyond)}, which this dataset has not ({cfg.num_samples} "
                "samples): the log was edited or is another dataset's: restore it, or extract again",
            )
        ]
    return []


def rows_per_folder(root: Path) -> int:
    """data_config.json's rows_per_folder (read_config reports an unreadable config, later)."""
    if (root / formats.DATA_CONFIG_FILE).exists():
        with contextlib.suppress(Exception):
            return formats.parse_data_config(formats.read_json(root / formats.DATA_CONFIG_FILE))[0].rows
    return formats.ROWS_PER_FOLDER


# ---------------------------------------------------------------------------------------------
# Dataset level
# ---------------------------------------------------------------------------------------------


def index_problems(listing: formats.DatasetFiles, expected_count: int | None) -> list[Problem]:
    out = []
    by_index: dict[int, list[Path]] = defaultdict(list)
    for i, p in listing.files:
        by_index[i].append(p)
    for i, paths in sorted(by_index.items()):
        if len(paths) > 1:
            out.append(
                Problem(
                    DUPLICATE_INDEX,
                    str(paths[1]),
                    f"index {i} appears {len(paths)} times: " + ", ".join(str(p) for p in paths),
                )
            )
    n = expected_count if expected_count is not None else (max(by_index) + 1 if by_index else 0)
    # counted, never listed: a recorded count is data (a damaged one of 1e11 once took 23 GB here)
    num_missing = n - sum(1 for i in by_index if i < n)
    if num_missing:
        first = list(itertools.islice((i for i in range(n) if i not in by_index), 10))
        out.append(
            Problem(
                MISSING_INDEX,
                "",
                f"{num_missing} of {n} indices have no file: {', '.join(map(str, first))}"
                + (", ..." if num_missing > len(first) else ""),
            )
        )
    extra = sorted(i for i in by_index if i >= n)
    if extra:
        out.append(Problem(MISSING_INDEX, "", f"indices {fmt_rows(extra, 10)} beyond the {n} samples recorded"))
    return out + placement_problems(listing)


def placement_problems(listing: formats.DatasetFiles) -> list[Problem]:
    """Files where the layout does not put them, files of no layout, links that lead nowhere."""
    out = [Problem(FOLDER_NAMING, str(p), why) for _, p, why in listing.misplaced]
    out += [
        Problem(STRAY_FILE, str(p), "not a hidden-state file of this layout (a killed writer's temp file?)", WARNING)
        for p in listing.stray
    ]
    out += [
        Problem(BROKEN_LINK, str(p), f"{why}; replace it with the file or remove it") for p, why in listing.broken_links
    ]
    out += [Problem(BROKEN_LINK, str(p), why, WARNING) for p, why in listing.unfollowed_links]
    return out


def config_totals_problems(cfg: formats.DataConfig, results: list[FileResult]) -> list[Problem]:
    """data_config.json's counts against the files (only meaningful when every file read)."""
    out = []
    lengths = [r.length for r in results if r.length is not None]
    facts = {
        "num_samples": len(results),
        "num_tokens": sum(lengths),
        "num_masked_tokens": sum(r.masked for r in results),
        "seq_length": max(lengths, default=0),
    }
    for key, actual in facts.items():
        recorded = getattr(cfg, key)
        if recorded is not None and recorded != actual:
            out.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"{key} is {recorded}, the files hold {actual}"))
    if cfg.max_length is not None and facts["seq_length"] > cfg.max_length:  # the bound prepare truncated to
        out.append(
            Problem(
                DATA_CONFIG,
                formats.DATA_CONFIG_FILE,
                f"max_length is {cfg.max_length}, but the files hold a sample of {facts['seq_length']} tokens",
            )
        )
    return out


def sample_lengths_problems(root: Path, results: list[FileResult], required: bool) -> list[Problem]:
    path = root / formats.SAMPLE_LENGTHS_FILE
    name = formats.SAMPLE_LENGTHS_FILE
    if not path.exists():
        return [Problem(SAMPLE_LENGTHS, name, "missing", ERROR if required else WARNING)] if required else []
    try:
        recorded = formats.read_sample_lengths(path)
    except Exception as e:
        return [Problem(SAMPLE_LENGTHS, name, f"unreadable: {type(e).__name__}: {e}")]
    actual = {r.index: r.length for r in results if r.length is not None}
    out = []
    wrong = [(i, recorded[i], n) for i, n in sorted(actual.items()) if i in recorded and recorded[i] != n]
    for i, rec, n in wrong[:3]:
        out.append(
            Problem(
                SAMPLE_LENGTHS,
                name,
                f"sample {i}: recorded length {rec}, file has {n}"
                + (f" ({len(wrong)} samples disagree)" if len(wrong) > 1 else ""),
            )
        )
    files = {r.index for r in results}
    only_rec, only_files = sorted(set(recorded) - files), sorted(files - set(recorded))
    if only_rec:
        out.append(Problem(SAMPLE_LENGTHS, name, f"lists {len(only_rec)} samples with no file: {fmt_rows(only_rec)}"))
    if only_files:
        out.append(
            Problem(SAMPLE_LENGTHS, name, f"misses {len(only_files)} samples that have files: {fmt_rows(only_files)}")
        )
    return out


def load_token_freq(root: Path, required: bool) -> tuple[dict[int, int] | None, list[Problem]]:
    """The recorded counts, or why there are none. A 50k-entry dict takes ~0.3 s through the
    weights-only unpickler (pure Python), so check_dataset reads it beside the file scan."""
    path = root / formats.TOKEN_FREQ_FILE
    name = formats.TOKEN_FREQ_FILE
    if not path.exists():
        return None, [Problem(TOKEN_FREQ, name, "missing")] if required else []
    try:
        return formats.read_token_freq(path), []
    except Exception as e:
        return None, [load_problem(e, name)] if is_unsafe_pickle_error(e) else [
            Problem(TOKEN_FREQ, name, f"unreadable: {type(e).__name__}: {str(e)[:160]}")
        ]


def token_freq_problems(recorded: dict[int, int], results: list[FileResult], complete: bool = True) -> list[Problem]:
    """token_freq.pt against the files' masked tokens; `complete`: every sample has its file (a
    missing one's tokens are counted in token_freq.pt: the files, not the counts, are short)."""
    actual: Counter = Counter()
    for r in results:
        for t, c in zip(*r.masked_tokens):
            actual[t] += c
    diff = sorted(t for t in set(recorded) | set(actual) if recorded.get(t, 0) != actual.get(t, 0))
    if not diff:
        return []
    t = diff[0]
    held = [r.path for r in results if t in r.masked_tokens[0]]  # for the one id named only
    where = f"in {fmt_paths(held)}" if held else "in no file"
    if not complete:
        cause = "samples have no file (named above), and their tokens are counted here: extract those files again"
    elif results and all(r.tokens_signed for r in results):
        # every file's ids and mask are what extraction wrote beside its states: the counts changed
        cause = (
            "every file's input_ids and loss_mask match the digest extraction recorded, so this file is what "
            "changed: copy token_freq.pt from the prepared folder the dataset was extracted from (its "
            "extract command is in data_config.json's command), or extract again"
        )
    else:
        cause = (
            "token_freq.pt or a file's input_ids or loss_mask changed since the counts were made (a file "
            "whose tokens differ from the digest extraction recorded is named above, by its state signature); "
            "if none is, copy token_freq.pt from the prepared folder again, or prepare and extract again"
        )
    return [
        Problem(
            TOKEN_FREQ,
            formats.TOKEN_FREQ_FILE,
            f"disagrees with the files' masked tokens on {len(diff)} token ids "
            f"(e.g. id {t}: recorded {recorded.get(t, 0)}, files have {actual.get(t, 0)} {where}; "
            f"recorded total {sum(recorded.values())}, files {sum(actual.values())}): {cause}",
        )
    ]


def fmt_paths(paths: list[str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown} more files" if len(paths) > shown else ""
    return ", ".join(sorted(paths)[:shown]) + more


def rms_outlier_problems(results: list[FileResult]) -> list[Problem]:
    out = []
    num = max((len(r.slot_median_row_rms) for r in results), default=0)
    for j in range(num):
        vals = [
            (r, r.slot_median_row_rms[j])
            for r in results
            if len(r.slot_median_row_rms) > j
            and math.isfinite(r.slot_median_row_rms[j])
            and r.slot_median_row_rms[j] > 0
        ]
        if len(vals) < 3:
            continue
        med = sorted(v for _, v in vals)[len(vals) // 2]
        for r, v in vals:
            if v > med * RMS_OUTLIER_FACTOR or v < med / RMS_OUTLIER_FACTOR:
                out.append(
                    Problem(
                        RMS_BOUNDS,
                        r.path,
                        f"slot {j} median row RMS {v:.3g} is {v / med:.3g}x the dataset's "
                        f"median {med:.3g} for this slot",
                    )
                )
    return out


# A slot whose scale (log of the file's median row RMS) is SLOT_FAR median absolute deviations from
# its slot's typical scale, and SLOT_NEAR times closer to another slot's typical scale than to its
# own, holds another layer's states (two slots swapped, or one slot filled from the wrong layer):
# checked in every file, from figures the scan computes anyway. Only between slots whose typical
# scales are SLOT_APART deviations apart, so noise is never read as a swap.
SLOT_FAR, SLOT_NEAR, SLOT_APART = 8.0, 3.0, 3.0
SLOT_MIN_FILES = 5
SLOT_MIN_SPREAD = 0.01  # log units: a floor on the deviation of a slot that every file has at one scale


def slot_scales(results: list[FileResult]) -> tuple[list[FileResult], list[list[float]]]:
    """The files whose every slot has a positive finite median row RMS, and those scales (logs)."""
    files = [
        r for r in results if r.slot_median_row_rms and all(math.isfinite(v) and v > 0 for v in r.slot_median_row_rms)
    ]
    width = max((len(r.slot_median_row_rms) for r in files), default=0)
    files = [r for r in files if len(r.slot_median_row_rms) == width]
    return files, [[math.log(v) for v in r.slot_median_row_rms] for r in files]


def slot_order_problems(results: list[FileResult], layer_names: list[str]) -> list[Problem]:
    """Files in which a slot's scale is another slot's: the states of one layer stored under
    another's id in that file (a swap, or a wrong layer), which a check that samples files with
    the target would miss and training would learn from."""
    files, scales = slot_scales(results)
    if len(files) < SLOT_MIN_FILES:
        return []
    width = len(scales[0])
    typical = [statistics.median(x[j] for x in scales) for j in range(width)]
    spread = [max(SLOT_MIN_SPREAD, statistics.median(abs(x[j] - typical[j]) for x in scales)) for j in range(width)]
    name = lambda j: layer_names[j] if j < len(layer_names) else f"slot {j}"  # noqa: E731
    out = []
    for r, x in zip(files, scales):
        if r.states_signed:  # its slots are what extraction wrote there: an unusual scale is the sample's own
            continue
        for j in range(width):
            own = abs(x[j] - typical[j])
            if own / spread[j] <= SLOT_FAR:
                continue
            for k in range(width):
                apart = abs(typical[j] - typical[k]) / max(spread[j], spread[k])
                if k != j and apart > SLOT_APART and abs(x[j] - typical[k]) * SLOT_NEAR <= own:
                    out.append(
                        Problem(
                            LAYER_IDENTITY,
                            r.path,
                            (
                                f"slot {j} ({name(j)}) has the scale of slot {k} ({name(k)}): median row RMS "
                                f"{math.exp(x[j]):.3g}, where this dataset's slot {j} has {math.exp(typical[j]):.3g} and "
                                f"slot {k} {math.exp(typical[k]):.3g}; its states are another layer's (slots swapped or "
                                f"filled from the wrong layer): re-extract this file"
                            ),
                        )
                    )
                    break
    return out


def slot_stats(results: list[FileResult], layer_names: list[str]) -> list[SlotStats]:
    out = []
    num = max((len(r.slot_sumsq) for r in results), default=0)
    for j in range(num):
        rs = [r for r in results if len(r.slot_elems) > j and r.slot_elems[j]]
        if not rs:
            continue
        sumsq, elems = sum(r.slot_sumsq[j] for r in rs), sum(r.slot_elems[j] for r in rs)
        meds = [r.slot_median_row_rms[j] for r in rs]
        out.append(
            SlotStats(
                j,
                layer_names[j] if j < len(layer_names) else "?",
                math.sqrt(sumsq / elems),
                sum(meds) / len(meds),
                min(meds),
                max(meds),
                max(r.slot_max_row_rms[j] for r in rs),
            )
        )
    return out


def length_histogram(lengths: list[int]) -> dict[str, int]:
    """Power-of-two buckets: the shape that decides padding waste and batch sizes."""
    hist: Counter = Counter()
    for n in lengths:
        lo = 0 if n < 64 else 1 << (n.bit_length() - 1)
        hist[lo] += 1
    return {(f"{lo}-{max(lo * 2, 64) - 1}"): hist[lo] for lo in sorted(hist)}


# ---------------------------------------------------------------------------------------------
# The entry function and its steps
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def single_threaded_ops() -> Iterator[None]:
    """One intra-op thread per torch op while files are checked in parallel: the per-file ops
    are small (a few MB), and OpenMP teams on top of the reader threads made the scan 3-10x
    slower and erratic on 2 cores (measured). Process-wide, so restored right after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_target(
    report: CheckReport,
    cfg: formats.DataConfig | None,
    target: str | None,
    use_target: bool,
    placed: Placement | None = None,
) -> tuple[Any, Any, Any]:
    """(tokenizer, model, input device) of the target checked against, all None when there is none."""
    spec = target or (cfg.target_path if cfg else None)
    if not use_target:
        report.problems.append(
            Problem(NOT_CHECKED, "", "layer identity and mask vs template skipped (--no-target)", WARNING)
        )
    elif not spec:
        report.problems.append(
            Problem(
                NOT_CHECKED,
                "",
                "layer identity and mask vs template skipped: no --target and no target_path in data_config.json",
                WARNING,
            )
        )
    else:
        try:
            ref, tokenizer, model, device = load_target_for_check(spec, cfg, placed)
        except Exception as e:
            # --target, or options that place the target (--device-map...), ask for these checks: one
            # that cannot run is not a pass. A target merely recorded in data_config.json may live on
            # another machine: then a warning.
            asked = target is not None or placed is not None
            report.problems.append(
                Problem(
                    NOT_CHECKED,
                    str(spec),
                    f"layer identity and mask vs template "
                    f"{'could not run' if asked else 'skipped'}: "
                    f"target not loadable ({type(e).__name__}: {e})",
                    ERROR if asked else WARNING,
                )
            )
            return None, None, None
        report.target = ref.name
        report.problems += [p for p in [target_revision_problem(cfg, ref)] if p]
        return tokenizer, model, device
    return None, None, None


def expect_template(report: CheckReport, exp: Expect, tokenizer: Any, cfg: formats.DataConfig | None) -> None:
    """The chat template's generation prompt and end-of-turn tokens, for every file's mask check."""
    gp = generation_prompt(tokenizer)
    if not gp:
        report.problems.append(
            Problem(
                NOT_CHECKED,
                "",
                "mask vs template skipped: the chat template has no separable generation prompt",
                WARNING,
            )
        )
        return
    exp.gen_prompt_ids, report.generation_prompt = gp
    exp.eot_ids = frozenset(special_token_ids(tokenizer))
    other = template_mismatch(cfg.chat_template_sha256 if cfg else None, tokenizer)
    if other:
        report.problems.append(Problem(MASK_TEMPLATE, formats.DATA_CONFIG_FILE, other))


def scan_files(
    root: Path, files: list[tuple[int, Path]], exp: Expect, workers: int, required: bool
) -> tuple[list[FileResult], dict[int, int] | None, list[Problem]]:
    """Every file checked, in threads, with token_freq.pt read beside them: (results, recorded
    frequencies, their problems). Threads, not processes: torch.load reads and every tensor op
    here release the GIL, and threads avoid pickling tensors back from workers (measured faster
    on 2 cores)."""
    with ThreadPoolExecutor(max_workers=workers) as pool, single_threaded_ops():
        freq_future = pool.submit(load_token_freq, root, required)
        results = list(pool.map(lambda ip: check_file(ip[0], ip[1], root, exp), files))
        recorded_freq, freq_problems = freq_future.result()
    return results, recorded_freq, freq_problems


def side_file_problems(
    root: Path,
    listing: formats.DatasetFiles,
    cfg: formats.DataConfig | None,
    table_rows: int | None,
    unique: list[FileResult],
    required: bool,
) -> list[Problem]:
    """The indices, sample_lengths.json and data_config.json's totals against the files."""
    out = []
    recorded = cfg.num_samples if cfg else None
    if recorded is not None and table_rows is not None and recorded != table_rows:
        out.append(
            Problem(
                DATA_CONFIG,
                formats.DATA_CONFIG_FILE,
                f"num_samples is {recorded}, the Arrow table has {table_rows} rows",
            )
        )
    out += index_problems(listing, table_rows if table_rows is not None else recorded)
    out += sample_lengths_problems(root, unique, required)
    return out


def slot_names(cfg: formats.DataConfig | None) -> list[str]:
    """ "layer K" for each stored slot, as data_config.json records them (none when it does not)."""
    ids = cfg.layer_ids if cfg is not None else None
    return [f"layer {k}" for k in ids] if isinstance(ids, list) else []


def fill_totals(report: CheckReport, results: list[FileResult], unique: list[FileResult], layer_ids: Any) -> None:
    names = [f"layer {k}" for k in layer_ids] if isinstance(layer_ids, list) else []
    report.slots = slot_stats(results, names)
    report.files = len(results)
    report.samples = len(unique)
    lengths = [r.length for r in unique if r.length is not None]
    report.tokens, report.masked_tokens = sum(lengths), sum(r.masked for r in unique)
    report.bytes = sum(r.nbytes for r in results)
    report.length_histogram = length_histogram(lengths)


def check_identity(
    report: CheckReport,
    root: Path,
    exp: Expect,
    model: Any,
    device: Any,
    results: list[FileResult],
    cfg: formats.DataConfig | None,
    layer_ids: list[int],
    identity_samples: int,
) -> None:
    """Layer identity on sampled files, unless the recorded shape already rules the target out."""
    n = model.config.num_hidden_layers
    last_conv = (cfg.last_hidden_state if cfg else None) or exp.layout.last_state
    vocab = getattr(model.config, "vocab_size", None)
    if cfg is not None and cfg.vocab_size is not None and vocab is not None and cfg.vocab_size != vocab:
        report.problems.append(
            Problem(
                LAYER_IDENTITY,
                formats.DATA_CONFIG_FILE,  # train refuses it: say so first
                f"vocab_size {cfg.vocab_size} is not the target's {vocab}",
            )
        )
    if exp.hidden_size is not None and exp.hidden_size != model.config.hidden_size:
        report.problems.append(
            Problem(
                LAYER_IDENTITY,
                formats.DATA_CONFIG_FILE,
                f"hidden size {exp.hidden_size} is not the target's {model.config.hidden_size}",
            )
        )
    elif any(not 0 <= k <= n for k in layer_ids):
        report.problems.append(
            Problem(
                LAYER_IDENTITY,
                formats.DATA_CONFIG_FILE,
                f"layer_ids {layer_ids} are not all in 0..{n} for this {n}-layer target",
            )
        )
    elif isinstance(model, TargetHeads):
        heads_check(report, root, exp, model, pick_identity_files(results, identity_samples), last_conv)
    else:
        identity_check(
            report, root, exp, model, pick_identity_files(results, identity_samples), layer_ids, last_conv, device
        )


NO_LAYOUT = (
    "no v1 (hidden_states/rows_*/data_*.pt), compact, speculators (Arrow table + "
    "hidden_states/hs_*.safetensors), flat data_*.pt, SpecForge *.ckpt[.gz] or hs_*.safetensors files found"
)


def table_rows_of(report: CheckReport, root: Path, layout: formats.Layout) -> tuple[bool, int | None]:
    """(readable, rows) of a layout's table (rows None for a layout without one)."""
    if layout.table is None:
        return True, None
    try:
        return True, layout.table.count(root)
    except ValueError as e:
        report.problems.append(Problem(UNREADABLE, layout.table.state_file, str(e)))
        return False, None


def dataset_problems(
    root: Path,
    listing: formats.DatasetFiles,
    cfg: formats.DataConfig | None,
    table_rows: int | None,
    results: list[FileResult],
    unique: list[FileResult],
    recorded_freq: Any,
    required: bool,
    model: Any,
) -> list[Problem]:
    """What only the whole dataset shows: side files, token counts, totals, lengths, RMS outliers."""
    out = side_file_problems(root, listing, cfg, table_rows, unique, required)
    if recorded_freq is not None:
        complete = not any(p.kind == MISSING_INDEX for p in out)
        out += token_freq_problems(recorded_freq, unique, complete)
    if cfg is not None:
        out += config_totals_problems(cfg, unique)
    if model is not None:
        out += too_long_problems(unique, model)
    return out + rms_outlier_problems(results) + slot_order_problems(results, slot_names(cfg))


def check_dataset(options: CheckOptions) -> CheckReport:
    """Check every file of the hidden-state dataset at `path`; with a target (`target`, else
    data_config's `target_path`, placed by `device_map` when given), also layer identity and
    mask-vs-template on sampled files."""
    target, use_target, identity_samples, workers = (
        options.target,
        options.use_target,
        options.identity_samples,
        options.workers,
    )
    options.check_numbers()
    placed = placement_from_options(options.device_map, options.max_memory, options.offload_folder)
    if target is not None and not use_target:
        raise ValueError(f"--target {target} asks for the checks with the target, and --no-target skips them: give one")
    if placed is not None and not use_target:
        raise ValueError(f"--device-map {options.device_map} places the target, and --no-target skips it: give one")
    root = Path(options.path)
    report = CheckReport(str(root))
    if not root.is_dir():
        report.problems.append(Problem(NO_FILES, str(root), "not a folder"))
        return report
    listing = formats.list_dataset_files(root, rows_per_folder(root))
    report.format, layout = listing.format, listing.layout
    if layout is None:
        report.problems.append(Problem(NO_FILES, str(root), NO_LAYOUT))
        return report
    cfg, cfg_problems = read_config(root, layout)
    report.problems += cfg_problems
    readable, table_rows = table_rows_of(report, root, layout)
    if not readable:
        return report
    # The target (and its tokenizer) first: the tokenizer lets every file's mask be checked.
    tokenizer, model, device = check_target(report, cfg, target, use_target, placed)
    files = sorted(listing.files, key=lambda ip: (ip[0], str(ip[1])))
    vocab = cfg.vocab_size if cfg and cfg.vocab_size is not None else (model.config.vocab_size if model else None)
    t0 = time.time()
    exp = expectations(root, files, cfg, layout, vocab)
    if tokenizer is not None:
        expect_template(report, exp, tokenizer, cfg)
    report.workers = workers or min(8, os.cpu_count() or 1)
    results, recorded_freq, freq_problems = scan_files(root, files, exp, report.workers, layout.side_files)
    report.seconds = time.time() - t0
    report.problems += exp.problems + [p for r in results for p in r.problems] + freq_problems
    report.template_checked_files = sum(r.template_checked for r in results)
    unique = list({r.index: r for r in results}.values())
    report.problems += dataset_problems(
        root, listing, cfg, table_rows, results, unique, recorded_freq, layout.side_files, model
    )
    layer_ids = cfg.layer_ids if cfg else None
    if model is not None and layer_ids is None:
        layer_ids = layers.default_layer_ids(model.config.num_hidden_layers)
    fill_totals(report, results, unique, layer_ids)
    if model is not None and layer_ids is not None:
        check_identity(report, root, exp, model, device, results, cfg, layer_ids, identity_samples)
    return report
