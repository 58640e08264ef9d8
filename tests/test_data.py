"""Chat reading and the assistant-only loss mask, checked against independent references:
every run of masked tokens must decode to exactly that assistant turn's text plus its
end-of-turn token."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eaglet import formats
from eaglet.chat import ReadStats, TemplateSpanError, iter_records, to_messages, tokenize_chat
from eaglet.prepare import TRUNCATED_AWAY, prepare
from eaglet.options import PrepareOptions

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Renders earlier assistant turns differently from the last one (as templates that strip
# reasoning from history do): the spans of earlier turns cannot be derived.
HISTORY_REWRITING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n[earlier answer]<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TEST_CHATS = [
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [
        {"role": "system", "content": "You answer in code."},
        {"role": "user", "content": "Sum in Python?"},
        {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"},
        {"role": "user", "content": "And in C?"},
        {"role": "assistant", "content": "int add(int a, int b) { return a + b; }"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "De rien ! 😊 不客气。"},
    ],
    [{"role": "user", "content": "Trailing?"}, {"role": "assistant", "content": "trailing spaces and a newline  \n"}],
]


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for tok, m in zip(ids, mask):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def assert_mask_decodes_to_assistant_turns(tokenizer, chat, eot: str, trims: bool) -> None:
    ids, mask, missing_eot = tokenize_chat(tokenizer, chat)
    assert missing_eot == 0
    # The tokens are exactly what the template renders.
    assert ids == tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    expected = [(m["content"].strip() if trims else m["content"]) + eot for m in chat if m["role"] == "assistant"]
    got = [tokenizer.decode(run, clean_up_tokenization_spaces=False) for run in masked_runs(ids, mask)]
    assert got == expected


def with_template(tokenizer_dir: Path, template: str, specials: list[str], bos: str, eos: str):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.bos_token, tok.eos_token = bos, eos
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("chat", TEST_CHATS)
def test_mask_smollm2_template(smollm2_dir, chat):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert_mask_decodes_to_assistant_turns(tok, chat, "<|im_end|>", trims=False)


@pytest.mark.parametrize("chat", TEST_CHATS)
def test_mask_llama3_template(smollm2_dir, chat):
    tok = with_template(
        smollm2_dir,
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    )
    assert_mask_decodes_to_assistant_turns(tok, chat, "<|eot_id|>", trims=True)


@pytest.mark.parametrize("chat", [c for c in TEST_CHATS if c[0]["role"] != "system"])
def test_mask_gemma_template(tiny_target, chat):
    tok = with_template(
        tiny_target, GEMMA_TEMPLATE, ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>"
    )
    assert_mask_decodes_to_assistant_turns(tok, chat, "<end_of_turn>", trims=True)


def test_mask_tiny_chatml(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    for chat in TEST_CHATS:
        assert_mask_decodes_to_assistant_turns(tok, chat, "<|im_end|>", trims=False)


def test_mask_leading_whitespace_merged_into_the_prompt(smollm2_dir):
    """SmolLM2's tokenizer merges the prompt's final newline with an answer's leading spaces
    into one token; that token starts in the template, so it stays unmasked and the run
    decodes to the rest of the answer."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [{"role": "user", "content": "Padded?"}, {"role": "assistant", "content": "  leading spaces"}]
    ids, mask, _ = tokenize_chat(tok, chat)
    (run,) = masked_runs(ids, mask)
    decoded = tok.decode(run, clean_up_tokenization_spaces=False)
    assert decoded.endswith("<|im_end|>") and chat[1]["content"].endswith(decoded.removesuffix("<|im_end|>"))
    assert "leading spaces" in decoded


def test_mask_never_covers_user_or_system_text(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    ids, mask, _ = tokenize_chat(tok, TEST_CHATS[1])
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m], clean_up_tokenization_spaces=False)
    for m in TEST_CHATS[1]:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert "<|im_start|>assistant\n" in unmasked  # the generation prompt is template, not assistant output


def test_template_that_rewrites_history_fails_clearly(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = HISTORY_REWRITING_TEMPLATE
    with pytest.raises(TemplateSpanError, match="assistant turn 2's text does not follow its generation prompt"):
        tokenize_chat(tok, TEST_CHATS[1])


def test_prepare_refuses_a_template_that_never_works(tiny_target, tmp_path):
    bad = tmp_path / "bad_target"
    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = HISTORY_REWRITING_TEMPLATE
    tok.save_pretrained(bad)
    (bad / "config.json").write_text((tiny_target / "config.json").read_text())
    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(json.dumps({"messages": TEST_CHATS[1]}) + "\n" for _ in range(25)))
    with pytest.raises(TemplateSpanError, match="first 20 chats all failed"):
        prepare(PrepareOptions(target=str(bad), data=str(chats), out=tmp_path / "out"))


# ------------------------------------------------------------------------------------------
# Reading and normalizing records
# ------------------------------------------------------------------------------------------


def test_sharegpt_roles_mapped_odd_ones_counted():
    stats = ReadStats()
    rec = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "q"},
            {"from": "tool", "value": "x"},
            {"from": "gpt", "value": "a"},
            {"from": "user", "value": "q2"},
            {"from": "chatgpt", "value": "a2"},
            {"from": "human", "value": "dangling"},
        ]
    }
    msgs = to_messages(rec, stats)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert stats.dropped_roles == {"tool": 1}


@pytest.mark.parametrize(
    "record,reason",
    [
        ("just a string", "record is not an object"),
        ({"id": 1}, "no 'conversations' or 'messages' list"),
        ({"conversations": [{"value": "x"}]}, "message without a string 'from'"),
        ({"conversations": [{"from": "human", "value": 3}]}, "message with non-string 'value'"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
    ],
)
def test_malformed_records_give_a_reason(record, reason):
    assert to_messages(record, ReadStats()) == reason


def test_non_alternating_chat_is_cut_there():
    stats = ReadStats()
    rec = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": "again"},
            {"role": "user", "content": "q2"},
        ]
    }
    assert [m["content"] for m in to_messages(rec, stats)] == ["q", "a"]
    assert sum(stats.trimmed.values()) == 1


def test_truncated_json_array_keeps_complete_records(tmp_path, caplog):
    good = [
        {"id": str(i), "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        for i in range(3)
    ]
    text = json.dumps(good)
    path = tmp_path / "cut.json"
    path.write_text(text[:-1] + ', {"id": "3", "conversations": [{"from": "hum')
    stats = ReadStats()
    with caplog.at_level(logging.WARNING):
        ids = [rid for rid, _ in iter_records(str(path), stats)]
    assert ids == ["0", "1", "2"] and stats.truncated_input
    assert "cut off mid-record" in caplog.text and "3 complete records" in caplog.text


def test_syntax_error_inside_a_closed_json_array_is_an_error_not_a_cut(tmp_path):
    """`[r, r, {bad}, r x100]` is not a cut-off file: treating it as one would drop 101 records."""
    good = [
        {"id": str(i), "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        for i in range(103)
    ]
    text = json.dumps(good[:2])[:-1] + ', {"id": "bad", "conversations": [oops]}, ' + json.dumps(good[2:])[1:]
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"broken.json: invalid JSON after record 2 .*not a cut-off file"):
        list(iter_records(str(path), ReadStats()))


def test_embedded_sharegpt_streams_all_complete_records():
    stats = ReadStats()
    assert sum(1 for _ in iter_records("sharegpt", stats)) == 17671
    assert stats.truncated_input


def test_jsonl_bad_line_is_counted_not_fatal(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n{oops\n')
    stats = ReadStats()
    assert len(list(iter_records(str(path), stats))) == 1
    assert stats.skipped["invalid JSON line"] == 1


def test_jsonl_line_not_utf8_is_counted_and_named(tmp_path, caplog):
    chat = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    path = tmp_path / "x.jsonl"
    path.write_bytes(chat + b'{"messages": "caf\xe9"}\n' + chat)
    stats = ReadStats()
    with caplog.at_level(logging.WARNING):
        assert len(list(iter_records(str(path), stats))) == 2
    assert stats.skipped["line not UTF-8"] == 1
    assert "x.jsonl:2: line not UTF-8 skipped" in caplog.text


# ------------------------------------------------------------------------------------------
# The prepare stage
# ------------------------------------------------------------------------------------------


def test_prepare_writes_dataset_with_counts(tiny_target, chats_jsonl, tmp_path):
    out = tmp_path / "prep"
    summary = prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=out, max_length=512))
    samples, config = formats.read_prepared(out)
    assert len(samples) == summary.samples == 12 == config["num_samples"]
    freq = formats.read_token_freq(out / formats.TOKEN_FREQ_FILE)
    expected: dict[int, int] = {}
    for s in samples:
        for t, m in zip(s.input_ids, s.loss_mask):
            if m:
                expected[t] = expected.get(t, 0) + 1
    assert freq == expected and sum(freq.values()) == config["num_masked_tokens"]


def test_prepare_mix_follows_data_with_its_own_skip_and_count(tiny_target, chats_jsonl, tmp_path):
    """--mix appends a second source's chats after --data's, each with its own skip and count: the
    recipe's original ShareGPT answers beside the regenerated ones."""
    other = tmp_path / "other.jsonl"
    other.write_text(
        "".join(json.dumps({"id": f"orig{n}", "messages": TEST_CHATS[n % len(TEST_CHATS)]}) + "\n" for n in range(6))
    )
    out = tmp_path / "prep"
    summary = prepare(
        PrepareOptions(
            target=str(tiny_target),
            data=str(chats_jsonl),
            out=out,
            max_length=512,
            num_samples=4,
            skip=1,
            mix=str(other),
            mix_skip=2,
            mix_samples=3,
        )
    )
    samples, config = formats.read_prepared(out)
    assert [s.sample_id for s in samples] == ["chat1", "chat2", "chat3", "chat4", "orig2", "orig3", "orig4"]
    assert summary.samples == 7 and config["samples_per_source"] == [4, 3] and config["mix"] == str(other)
    alone = prepare(
        PrepareOptions(
            target=str(tiny_target), data=str(other), out=tmp_path / "alone", max_length=512, skip=2, num_samples=3
        )
    )
    assert [s.input_ids for s in samples[4:]] == [s.input_ids for s in formats.read_prepared(alone.out)[0]]
    with pytest.raises(ValueError, match="--mix-samples / --mix-skip: set, but no --mix source"):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "p2", mix_samples=3))
    # a fault in the mix is the mix's, not --data's
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError, match=r"--mix .*folder: a folder, not a chat file"):
        prepare(
            PrepareOptions(
                target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "p3", mix=str(tmp_path / "folder")
            )
        )
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=r"--mix .*fifo: not a regular file; save the chats to a .json or .jsonl"):
        prepare(
            PrepareOptions(
                target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "p4", mix=str(tmp_path / "fifo")
            )
        )
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"--data .*empty.jsonl and --mix .*empty.jsonl: no usable chat in 0 records"):
        prepare(
            PrepareOptions(
                target=str(tiny_target),
                data=str(tmp_path / "empty.jsonl"),
                out=tmp_path / "p4",
                mix=str(tmp_path / "empty.jsonl"),
            )
        )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_length": -5}, "--max-length -5: must be >= 1"),
        ({"num_samples": 0}, "--num-samples 0: must be >= 1"),
        ({"skip": -1}, "--skip -1: must be >= 0"),
        ({"mix": "sharegpt", "mix_skip": -1}, "--mix-skip -1: must be >= 0"),
    ],
)
def test_prepare_refuses_out_of_range_numbers(tiny_target, chats_jsonl, tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "prep", **options))
    assert not (tmp_path / "prep").exists()


def test_prepare_never_replaces_a_prepared_dataset_unasked(tiny_target, chats_jsonl, tmp_path):
    out = tmp_path / "prep"
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=out, max_length=512))
    before = (out / formats.PREPARED_FILE).read_bytes()
    with pytest.raises(FileExistsError, match="already holds a prepared dataset.*--overwrite"):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=out, max_length=512, num_samples=1))
    assert (out / formats.PREPARED_FILE).read_bytes() == before
    assert (
        prepare(
            PrepareOptions(
                target=str(tiny_target), data=str(chats_jsonl), out=out, max_length=512, num_samples=1, overwrite=True
            )
        ).samples
        == 1
    )


def test_a_failed_overwrite_leaves_the_earlier_prepared_dataset_whole(tiny_target, chats_jsonl, tmp_path):
    """--overwrite with data that yields no usable chat, or no data at all: refused, and the finished
    dataset is still finished (config, samples and frequencies as they were)."""
    out = tmp_path / "prep"
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=out, max_length=512))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    no_answer = tmp_path / "q.jsonl"
    no_answer.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="no usable chat"):
        prepare(PrepareOptions(target=str(tiny_target), data=str(no_answer), out=out, max_length=512, overwrite=True))
    with pytest.raises(FileNotFoundError):
        prepare(
            PrepareOptions(
                target=str(tiny_target), data=str(tmp_path / "missing.jsonl"), out=out, max_length=512, overwrite=True
            )
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(formats.read_prepared(out)[0]) > 0


def test_prepare_drops_samples_with_no_assistant_token_after_truncation(tiny_target, tmp_path):
    long_user = "word " * 300
    chats = tmp_path / "c.jsonl"
    chats.write_text(
        json.dumps({"messages": [{"role": "user", "content": long_user}, {"role": "assistant", "content": "ok"}]})
        + "\n"
        + json.dumps({"messages": TEST_CHATS[0]})
        + "\n"
    )
    summary = prepare(PrepareOptions(target=str(tiny_target), data=str(chats), out=tmp_path / "out", max_length=64))
    assert summary.samples == 1 and summary.dropped_after_truncation == 1
    samples, _ = formats.read_prepared(tmp_path / "out")
    assert all(len(s.input_ids) <= 64 for s in samples)


def test_prepare_embedded_sharegpt_with_smollm2(smollm2_dir, tmp_path):
    summary = prepare(
        PrepareOptions(target=None, data="sharegpt", out=tmp_path / "prep", max_length=512, num_samples=8)
    )
    samples, config = formats.read_prepared(tmp_path / "prep")
    assert summary.samples == 8 and config["target_revision"]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for s in samples:
        for run in masked_runs(s.input_ids, s.loss_mask)[:-1]:  # the last run may be cut by max_length
            assert tok.decode(run[-1:]) == "<|im_end|>"


def target_with_positions(tiny_target: Path, tmp_path: Path, positions: int) -> Path:
    """A copy of the tiny target whose config holds `positions` positions."""
    folder = Path(shutil.copytree(tiny_target, tmp_path / f"target_{positions}"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return folder


def test_prepare_refuses_max_length_beyond_the_target_positions(tiny_target, chats_jsonl, tmp_path):
    target = target_with_positions(tiny_target, tmp_path, 24)
    with pytest.raises(
        ValueError,
        match=rf"^--max-length 25: more than the 24 positions the target holds "
        rf"\(max_position_embeddings in {target / 'config.json'}\); "
        rf"pass --max-length 24 or less$",
    ):
        prepare(PrepareOptions(target=str(target), data=str(chats_jsonl), out=tmp_path / "prep", max_length=25))
    assert not (tmp_path / "prep").exists()
    # Without --max-length the default is capped at the target's positions.
    prepare(PrepareOptions(target=str(target), data=str(chats_jsonl), out=tmp_path / "prep"))
    samples, config = formats.read_prepared(tmp_path / "prep")
    assert config["max_length"] == 24 and max(len(s.input_ids) for s in samples) == 24


def test_prepare_says_truncation_cut_every_chat(tiny_target, chats_jsonl, tmp_path):
    with pytest.raises(ValueError) as e:
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "prep", max_length=1))
    message = str(e.value)
    assert (
        "no usable chat in 12 records read; every chat was cut to nothing by --max-length 1 (no assistant token "
        "left in 12 of 12 records): raise it"
    ) in message and "\n" not in message
    assert f"skipped: {TRUNCATED_AWAY}: 12 (first: {chats_jsonl}:1 (id chat0))" in message
    chats_jsonl.write_text(chats_jsonl.read_text() + "{oops\n")
    with pytest.raises(
        ValueError,
        match=r"--max-length 1 \(no assistant token left in 12 of 13 records; the others "
        r"were skipped\): raise it; .*invalid JSON line: 1 \(first: .*:13\)",
    ):
        prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "prep", max_length=1))


def test_every_skip_reason_names_its_first_record(tiny_target, tmp_path):
    chat = {"messages": TEST_CHATS[0]}
    long_question = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    lines = [
        json.dumps(chat),
        json.dumps({"id": "q", "messages": [{"role": "user", "content": "only a question"}]}),
        "{oops",
        json.dumps("just a string"),
        json.dumps({"id": "long", **long_question}),
        json.dumps({"id": "twice", "messages": [*TEST_CHATS[0], TEST_CHATS[0][1]]}),
        json.dumps({"id": "tool", "messages": [TEST_CHATS[0][0], {"role": "tool", "content": "x"}, TEST_CHATS[0][1]]}),
        json.dumps({"id": "q2", "messages": [{"role": "user", "content": "another question"}]}),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    summary = prepare(PrepareOptions(target=str(tiny_target), data=str(path), out=tmp_path / "prep", max_length=64))
    assert summary.samples == 3 and summary.dropped_after_truncation == 1
    text = "\n".join(summary.lines())
    for line in (
        "skipped: no assistant turn: 2 (first: {p}:2 (id q))",
        "skipped: invalid JSON line: 1 (first: {p}:3)",
        "skipped: record is not an object: 1 (first: {p}:4)",
        f"skipped: {TRUNCATED_AWAY}: 1 (first: {{p}}:5 (id long))",
        "cut short: roles stop alternating: cut there: 1 (first: {p}:6 (id twice))",
        "dropped messages of role: tool: 1 (first: {p}:7 (id tool))",
    ):
        assert line.format(p=path) in text, text
    # A JSON array names its records by index.
    array = tmp_path / "mixed.json"
    array.write_text(json.dumps([chat, {"id": "q", "messages": [{"role": "user", "content": "only a question"}]}]))
    summary = prepare(PrepareOptions(target=str(tiny_target), data=str(array), out=tmp_path / "prep2", max_length=64))
    assert f"  skipped: no assistant turn: 1 (first: {array}[1] (id q))" in summary.lines()
