"""Chat data -> tokens + assistant-only loss mask (`eaglet prepare`): the chats of one or two
sources, tokenized with the target's template (`eaglet.chat`), written as a prepared dataset."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import TemplateSyntaxError
from tqdm import tqdm

from eaglet import __version__, formats
from eaglet.chat import (
    ReadStats,
    Tally,
    TemplateSpanError,
    iter_records,
    special_token_ids,
    template_hash,
    tokenize_chat,
    to_messages,
    within_chars,
    MAX_CHARS_PER_TOKEN,
)
from eaglet.formats import PREPARE_CONFIG_FILE, PREPARED_FILE, PreparedWriter, TokenizedSample
from eaglet.options import PREPARE_MAX_LENGTH, PrepareOptions
from eaglet.target import TargetRef, config_positions, config_where, load_chat_tokenizer, resolve_target, text_config

TRUNCATED_AWAY = "no assistant token left after truncation to --max-length"
FAILED_START = 20  # the first this many chats all failing the template: the template, not the data, is wrong


def checked_max_length(max_length: int | None, limit: int, ref: TargetRef) -> int:
    """`--max-length`, or the default capped at the target's positions; longer than they are is refused:
    extract would run the target past the positions it was trained for."""
    if max_length is None:
        return min(PREPARE_MAX_LENGTH, limit)
    if max_length > limit:
        raise ValueError(
            f"--max-length {max_length}: more than the {limit} positions the target holds "
            f"(max_position_embeddings in {config_where(ref)}); pass --max-length {limit} or less"
        )
    return max_length


def reason_lines(stats: ReadStats, template_failures: Tally) -> list[str]:
    """Every count of records skipped or cut short, by reason, each with its first case."""
    return [
        line
        for title, tally in (
            ("skipped", stats.skipped),
            ("cut short", stats.trimmed),
            ("dropped messages of role", stats.dropped_roles),
            ("template could not be applied", template_failures),
        )
        for line in tally.lines(title)
    ]


def no_usable_chat(
    data: str, stats: ReadStats, template_failures: Tally, first_failure: str | None, max_length: int, skip: int
) -> ValueError:
    """Why not one chat of `data` (the sources as named: "--data F", and "--mix G") made a sample,
    and what to do, in one line."""
    cut = stats.skipped[TRUNCATED_AWAY]
    if not stats.records:
        why = "it holds no chat record"
    elif skip >= stats.records:
        why = f"--skip {skip} passes over all {stats.records} records: lower it"
    elif cut:  # no sample came out, so every chat that got as far as its tokens was cut away
        others = "" if cut == sum(stats.skipped.values()) and not template_failures else "; the others were skipped"
        why = (
            f"every chat was cut to nothing by --max-length {max_length} (no assistant token left in {cut} of "
            f"{stats.records} records{others}): raise it"
        )
    else:
        why = "every record was skipped or failed the template: fix the records named, or use another --data"
    details = reason_lines(stats, template_failures)
    if first_failure:
        details.append(f"first template failure: {first_failure}")
    return ValueError(
        f"{data}: no usable chat in {stats.records} records read; {why}" + "".join(f"; {d}" for d in details)
    )


log = logging.getLogger(__name__)


@dataclass
class PrepareSummary:
    out: Path
    samples: int
    tokens: int
    masked_tokens: int
    stats: ReadStats
    dropped_after_truncation: int
    template_failures: Tally
    missing_eot_turns: int

    def lines(self) -> list[str]:
        s = self.stats
        out = [
            f"prepared {self.samples} samples, {self.tokens} tokens "
            f"({self.masked_tokens} assistant tokens, {self.masked_tokens / max(self.tokens, 1):.1%}) -> {self.out}",
            f"read {s.records} records"
            + (" (input cut off mid-record; complete records kept)" if s.truncated_input else ""),
        ]
        out += [f"  {line}" for line in reason_lines(s, self.template_failures)]
        if self.missing_eot_turns:
            out.append(f"  warning: {self.missing_eot_turns} assistant turns had no end-of-turn token after them")
        return out


@dataclass(frozen=True)
class Source:
    """One chat source of a prepared dataset: its first `skip` records passed over, at most `limit` chats kept."""

    data: str
    skip: int
    limit: int | None
    option: str = "--data"  # the option that named it, for messages


@dataclass
class Tokenizing:
    """What tokenizing the chats met along the way, for the summary and data_config.json."""

    stats: ReadStats = field(default_factory=ReadStats)
    template_failures: Tally = field(default_factory=Tally)
    first_failure: str | None = None
    missing_eot: int = 0
    per_source: list[int] = field(default_factory=list)


def sources_of(
    data: str, skip: int, num_samples: int | None, mix: str | None, mix_skip: int, mix_samples: int | None
) -> list[Source]:
    if mix is None and (mix_samples is not None or mix_skip):
        raise ValueError("--mix-samples / --mix-skip: set, but no --mix source to take them from")
    return [Source(data, skip, num_samples)] + (
        [Source(mix, mix_skip, mix_samples, "--mix")] if mix is not None else []
    )


def refuse_foreign_samples(existing: Path) -> None:
    """A prepared.jsonl without its config is a killed prepare's only when its first line is a
    prepared sample; anything else is someone's file, and is never replaced."""
    with open(existing, "rb") as f:
        first = f.readline()
    try:
        TokenizedSample.from_json(first.decode("utf-8"), f"{existing}:1")
    except (ValueError, UnicodeDecodeError):
        raise FileExistsError(
            f"{existing}: not a prepared dataset's file (its first line is no prepared sample), "
            "and prepare would replace it; nothing was written: choose another --out"
        ) from None


def refuse_existing(out: str | Path, overwrite: bool) -> None:
    """A finished prepared dataset is replaced only with --overwrite; one a kill cut short (no
    prepare_config.json, written last) is not a dataset, and this run replaces it."""
    existing = Path(out) / PREPARED_FILE
    if existing.exists() and not (Path(out) / PREPARE_CONFIG_FILE).exists():
        refuse_foreign_samples(existing)
        log.warning(
            "%s: an earlier `eaglet prepare` stopped before writing %s; replacing its output", out, PREPARE_CONFIG_FILE
        )
    elif existing.exists() and not overwrite:
        raise FileExistsError(
            f"--out {out} already holds a prepared dataset ({existing.name}); choose another "
            f"folder, or pass --overwrite to replace it"
        )


def tokenized(
    record: object,
    tokenizer,
    special_ids: set[int],
    max_length: int,
    seen: Tokenizing,
    sample_id: str,
    any_written: bool,
) -> TokenizedSample | None:
    """One record as a sample, or None when it is skipped (counted in `seen` with its reason)."""
    stats = seen.stats
    messages = to_messages(record, stats, max_messages=max_length)
    if isinstance(messages, str):
        stats.skip(messages)
        return None
    messages = within_chars(messages, max_length * MAX_CHARS_PER_TOKEN, stats, max_messages=max_length)
    if not messages:
        stats.skip(TRUNCATED_AWAY)
        return None
    try:
        ids, mask, no_eot = tokenize_chat(tokenizer, messages, special_ids, max_length)
    except TemplateSpanError as e:
        seen.first_failure = seen.first_failure or f"{stats.where}: {e}"
        seen.template_failures.add(str(e).split(" (")[0], stats.where)
        if not any_written and sum(seen.template_failures.values()) >= FAILED_START:
            raise TemplateSpanError(f"the first {FAILED_START} chats all failed; {seen.first_failure}") from e
        return None
    except TemplateSyntaxError as e:  # the target's template itself, not this record: no chat would render
        raise ValueError(
            f"the target's chat template does not parse ({e.message}, template line {e.lineno}); "
            "fix chat_template.jinja (or tokenizer_config.json's chat_template) in the target's folder"
        ) from None
    except Exception as e:  # a template raising on odd input (e.g. jinja `raise_exception`)
        seen.template_failures.add(f"template raised {type(e).__name__}: {str(e)[:80]}", stats.where)
        return None
    seen.missing_eot += no_eot
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        stats.skip(TRUNCATED_AWAY)
        return None
    return TokenizedSample(sample_id, ids, mask)


def write_source(
    writer: PreparedWriter,
    source: Source,
    tokenizer,
    special_ids: set[int],
    max_length: int,
    seen: Tokenizing,
    bar: tqdm,
) -> None:
    """The usable chats of one source, in order, appended to `writer`."""
    written_before = writer.samples
    for n, (sample_id, record) in enumerate(iter_records(source.data, seen.stats, source.option)):
        if n < source.skip:
            continue
        if source.limit is not None and writer.samples - written_before >= source.limit:
            break
        sample = tokenized(record, tokenizer, special_ids, max_length, seen, sample_id, writer.samples > 0)
        if sample is not None:
            writer.add(sample)
            bar.update(1)
    seen.per_source.append(writer.samples - written_before)


def prepared_config(
    ref: TargetRef,
    target: str | None,
    tokenizer,
    sources: list[Source],
    max_length: int,
    writer: PreparedWriter,
    seen: Tokenizing,
    command: str,
) -> dict:
    """prepare_config.json: where the chats came from, with what, and what was left out and why."""
    data, mix = sources[0], (sources[1] if len(sources) > 1 else None)
    stats = seen.stats
    return {
        "eaglet_version": __version__,
        "command": command,
        "target": ref.name,
        "target_spec": target,
        "target_path": ref.path,
        "target_revision": ref.revision,
        "chat_template_sha256": template_hash(tokenizer),
        "data": data.data,
        "skip": data.skip,
        "mix": mix.data if mix else None,
        "mix_skip": mix.skip if mix else 0,
        "mix_samples": mix.limit if mix else None,
        "samples_per_source": seen.per_source,
        "max_length": max_length,
        "num_samples": writer.samples,
        "num_tokens": writer.tokens,
        "num_masked_tokens": writer.masked_tokens,
        "records_read": stats.records,
        "skipped": dict(stats.skipped),
        "cut_short": dict(stats.trimmed),
        "dropped_roles": dict(stats.dropped_roles),
        "template_failures": dict(seen.template_failures),
        "dropped_after_truncation": stats.skipped[TRUNCATED_AWAY],
        "assistant_turns_without_eot": seen.missing_eot,
        "input_cut_off": stats.truncated_input,
    }


def prepare(options: PrepareOptions, command: str = "") -> PrepareSummary:
    """Tokenize chats with the target's template and write the prepared dataset to `out`; a
    prepared dataset already there is replaced only with `overwrite`. `max_length` (default
    PREPARE_MAX_LENGTH, or the target's positions where fewer) may not exceed the target's positions.
    `mix`: a second chat source whose chats follow those of `data` (its first `mix_skip` records
    skipped, at most `mix_samples` kept): e.g. ShareGPT's original answers beside the target's
    regenerated ones, more unique tokens for the price of extraction rather than of generation."""
    target, data, out, max_length, skip = options.target, options.data, options.out, options.max_length, options.skip
    num_samples, mix, mix_samples, mix_skip = options.num_samples, options.mix, options.mix_samples, options.mix_skip
    options.check_numbers()
    sources = sources_of(data, skip, num_samples, mix, mix_skip, mix_samples)
    formats.refuse_overlap(out, "prepare", {"--data": data, "--mix": mix, "--target": target})
    with formats.output_lock(out, "prepare"):  # one writer per output: a second is refused, naming the first
        refuse_existing(out, options.overwrite)
        ref = resolve_target(target)
        max_length = checked_max_length(max_length, config_positions(text_config(ref)), ref)
        tokenizer = load_chat_tokenizer(ref)
        special_ids = special_token_ids(tokenizer)
        seen = Tokenizing()
        limits = [source.limit for source in sources if source.limit is not None]
        bar = tqdm(
            total=sum(limits) if len(limits) == len(sources) else None,
            desc="prepare",
            unit="chat",
            file=sys.stderr,
            dynamic_ncols=True,
        )
        with PreparedWriter(out) as writer:
            for source in sources:
                write_source(writer, source, tokenizer, special_ids, max_length, seen, bar)
            bar.close()
            if not writer.samples:
                named = " and ".join(f"{s.option} {s.data}" for s in sources)
                raise no_usable_chat(named, seen.stats, seen.template_failures, seen.first_failure, max_length, skip)
        writer.finish(prepared_config(ref, target, tokenizer, sources, max_length, writer, seen, command))
        return PrepareSummary(
            Path(out),
            writer.samples,
            writer.tokens,
            writer.masked_tokens,
            seen.stats,
            seen.stats.skipped[TRUNCATED_AWAY],
            seen.template_failures,
            seen.missing_eot,
        )
