"""Chat files as users write them: a leading UTF-8 BOM, OpenAI's multi-part content, tool-call
turns, developer messages, reasoning; and one record far beyond --max-length, which must cost
memory by what is kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import write_jsonl
from helpers import run_with_peak_memory
from eaglet.chat import ReadStats, iter_records, to_messages
from eaglet.formats import read_prepared
from eaglet.prepare import prepare
from eaglet.options import PrepareOptions

CHAT = {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def read_all(path: Path) -> tuple[list, ReadStats]:
    stats = ReadStats()
    records = [to_messages(rec, stats) for _, rec in iter_records(str(path), stats)]
    return records, stats


def test_a_leading_bom_is_read_past_in_jsonl_and_json_arrays(tmp_path):
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_bytes("\ufeff".encode() + (json.dumps(CHAT) + "\n").encode() * 2)
    array = tmp_path / "chats.json"
    array.write_bytes("\ufeff".encode() + json.dumps([CHAT, CHAT]).encode())
    for path in (jsonl, array):
        records, stats = read_all(path)
        assert records == [CHAT["messages"]] * 2, path
        assert not stats.skipped, path


def test_multi_part_content_keeps_its_text_and_counts_what_it_drops(tmp_path):
    parts = {
        "id": "p",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe"},
                    {"type": "image_url", "image_url": {}},
                    {"type": "text", "text": "this."},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
    }
    records, stats = read_all(write_jsonl(tmp_path / "c.jsonl", [parts]))
    assert records == [[{"role": "user", "content": "Describe\nthis."}, {"role": "assistant", "content": "A cat."}]]
    assert stats.trimmed["non-text content parts dropped (counted per message)"] == 1


def test_tool_call_turns_are_skipped_and_counted_and_the_chat_kept(tmp_path):
    tools = {
        "id": "t",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "w"}}]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "It is 18C."},
        ],
    }
    records, stats = read_all(write_jsonl(tmp_path / "c.jsonl", [tools]))
    assert records == [
        [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is 18C."}]
    ]
    assert stats.trimmed["assistant tool-call turns skipped (counted per turn)"] == 1
    assert stats.dropped_roles["tool"] == 1


def test_developer_messages_mixed_keys_and_reasoning_are_read_or_counted(tmp_path):
    """OpenAI's `developer` role is the system message; a `messages` list written with ShareGPT's
    from/value keys is read as such; an assistant's reasoning_content is dropped and counted."""
    chat = {
        "id": "d",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."},
        ],
    }
    records, stats = read_all(write_jsonl(tmp_path / "c.jsonl", [chat]))
    assert records == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ]
    ]
    assert stats.trimmed == {"assistant reasoning_content dropped, the answer kept (counted per turn)": 1}
    assert not stats.dropped_roles and not stats.skipped
    late = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": "Be brief."},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "", "reasoning_content": "No answer follows."},
        ]
    }
    records, stats = read_all(write_jsonl(tmp_path / "late.jsonl", [late]))
    assert records == [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]]
    assert stats.dropped_roles["developer"] == 1 and not any("reasoning" in k for k in stats.trimmed)


def test_a_record_far_beyond_max_length_costs_memory_by_what_is_kept(tiny_target, tmp_path):
    """A 40 MB answer with --max-length 64: cut to its first 64 x 64 characters before it is
    rendered and tokenized, so prepare's peak memory stays near its baseline (the whole text once
    took 14.5 GB for 50 MB), and the sample keeps its first 64 tokens."""
    huge = {
        "id": "huge",
        "messages": [
            {"role": "user", "content": "Tell me a long story."},
            {"role": "assistant", "content": "The quick brown fox jumps. " * 1_500_000},
        ],
    }
    data = write_jsonl(tmp_path / "chats.jsonl", [CHAT, huge])
    _, peak_mib = run_with_peak_memory(
        f"from eaglet.options import PrepareOptions\n"
        f"from eaglet.prepare import prepare\nprepare(PrepareOptions(target={str(tiny_target)!r}, "
        f"data={str(data)!r}, out={str(tmp_path / 'out')!r}, max_length=64))"
    )
    assert peak_mib < 1500, f"peak {peak_mib:.0f} MiB"
    samples, _ = read_prepared(tmp_path / "out")
    assert len(samples) == 2 and len(samples[1].input_ids) == 64 and sum(samples[1].loss_mask) > 20


def test_prepare_reads_a_bom_file_end_to_end(tiny_target, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_bytes("\ufeff".encode() + (json.dumps(CHAT) + "\n").encode())
    prepare(PrepareOptions(target=str(tiny_target), data=str(data), out=tmp_path / "out"))
    assert len(read_prepared(tmp_path / "out")[0]) == 1


def test_a_json_array_is_read_as_json_load_reads_it(tmp_path):
    records = [CHAT, {"id": 7, "conversations": [{"from": "human", "value": "x", "n": [1.5, None, True, {}]}]}, 3, []]
    array = tmp_path / "chats.json"
    array.write_text(json.dumps(records))
    assert [rec for _, rec in iter_records(str(array), ReadStats())] == records


def test_a_record_nested_absurdly_deep_is_refused_by_index_in_bounded_memory(tmp_path):
    """40,000 levels inside a .json array: ijson's prefixed events cost memory with the square of
    the depth (this record took 4 GB, 100,000 levels 20 GB); it is refused, named by its index,
    with the process's peak near its baseline."""
    array = tmp_path / "chats.json"
    depth = 40_000
    array.write_text(f"[{json.dumps(CHAT)}, {'[' * depth}{']' * depth}, {json.dumps(CHAT)}]")
    (first,), peak_mib = run_with_peak_memory(
        "from eaglet.chat import ReadStats, iter_records\n"
        "read = []\ntry:\n"
        f"    for _, rec in iter_records({str(array)!r}, ReadStats()):\n        read.append(rec)\n"
        "except ValueError as e:\n    print(len(read), e)"
    )
    assert first.startswith(f"1 {array}[1]: nested deeper than 64 levels"), first
    assert peak_mib < 600, f"peak {peak_mib:.0f} MiB"


def test_a_chat_of_many_turns_costs_what_max_length_keeps(tiny_target, monkeypatch):
    """Each assistant turn renders the chat up to it again: 150,000 turns once meant hours. The
    messages are cut to --max-length (each renders a token at least) and turns past the kept
    tokens are not rendered; the kept tokens are those of the whole chat's first max_length."""
    from transformers import AutoTokenizer

    from eaglet import chat
    from eaglet.chat import MAX_CHARS_PER_TOKEN

    tok = AutoTokenizer.from_pretrained(tiny_target)
    turns = [{"role": r, "content": t} for _ in range(3000) for r, t in (("user", "hi"), ("assistant", "ok"))]
    stats = ReadStats()
    read = chat.to_messages({"messages": turns}, stats, max_messages=64)
    assert isinstance(read, list) and len(read) == 65  # not the 6,000: read one past what is kept
    kept = chat.within_chars(read, 64 * MAX_CHARS_PER_TOKEN, stats, max_messages=64)
    assert kept == turns[:64] and stats.trimmed["messages far beyond --max-length dropped before tokenizing"] == 1
    whole_ids, whole_mask, _ = chat.tokenize_chat(tok, kept)
    renders = []
    real_render = chat.render
    monkeypatch.setattr(chat, "render", lambda *a, **k: renders.append(1) or real_render(*a, **k))
    ids, mask, _ = chat.tokenize_chat(tok, kept, max_tokens=64)
    assert (ids, mask) == (whole_ids[:64], whole_mask[:64]) and any(mask)
    assert len(renders) < 16 < len(kept) // 2  # the whole chat once, then only the turns begun in 64 tokens


def test_a_compressed_chat_file_is_named_as_one(tmp_path):
    """A .jsonl.gz was read as text: every line skipped as "not UTF-8"."""
    import gzip

    packed = tmp_path / "chats.jsonl.gz"
    packed.write_bytes(gzip.compress((json.dumps(CHAT) + "\n").encode()))
    with pytest.raises(ValueError, match="chats.jsonl.gz: a gzip file; decompress it first"):
        read_all(packed)


def test_a_chat_template_that_does_not_parse_is_the_targets_fault(tiny_target, tmp_path):
    """Blamed on --data ("no usable chat ... fix the records") before."""
    import shutil

    target = Path(shutil.copytree(tiny_target, tmp_path / "target"))
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ m.content }"}))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    data = write_jsonl(tmp_path / "c.jsonl", [CHAT])
    with pytest.raises(ValueError, match=r"^the target's chat template does not parse \(.*fix chat_template.jinja"):
        prepare(PrepareOptions(target=str(target), data=str(data), out=tmp_path / "out"))


def test_an_integer_of_over_4300_digits_is_a_bad_line_not_the_end_of_the_run(tmp_path):
    """Python refuses to parse such an integer with a ValueError that is not a JSONDecodeError:
    prepare stopped on it, naming no file or line."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + '{"messages": [], "n": ' + "9" * 5000 + "}\n" + json.dumps(CHAT) + "\n")
    records, stats = read_all(path)
    assert records == [CHAT["messages"]] * 2
    assert stats.skipped["invalid JSON line"] == 1


def test_a_json_array_pretty_printed_into_a_jsonl_file_is_read_whole(tmp_path):
    """Read line by line, the records of `json.dump(chats, f, indent=2)` saved as .jsonl ended in
    commas: all but the last were skipped as invalid lines."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps([CHAT, CHAT, CHAT], indent=2))
    records, stats = read_all(path)
    assert records == [CHAT["messages"]] * 3 and not stats.skipped


def test_an_assistant_turn_of_weight_0_is_never_trained_on(tmp_path):
    """OpenAI's fine-tuning format marks a turn not to train on with "weight": 0; it was trained on."""
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "weight": 1},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "weight": 0},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f"},
    ]
    records, stats = read_all(write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns}]))
    assert records == [[{"role": t["role"], "content": t["content"]} for t in turns[:2]]]
    assert stats.trimmed["assistant turn of weight 0: chat cut there"] == 1


def test_utf16_and_carriage_return_line_endings_are_named(tmp_path):
    line = json.dumps(CHAT)
    utf16 = tmp_path / "u16.jsonl"
    utf16.write_bytes((line + "\n").encode("utf-16"))
    with pytest.raises(ValueError, match=r"u16.jsonl: a UTF-16 text file; save it as UTF-8"):
        read_all(utf16)
    cr = tmp_path / "cr.jsonl"
    cr.write_bytes(((line + "\r") * 2).encode())
    with pytest.raises(ValueError, match=r"cr.jsonl: its lines end in a carriage return alone"):
        read_all(cr)
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(((line + "\r\n") * 2).encode())
    assert read_all(crlf)[0] == [CHAT["messages"]] * 2
