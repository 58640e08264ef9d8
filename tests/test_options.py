"""One declaration per option (eaglet.options): the command line, recipe validation, the docs'
option tables and the stages' entry functions must all agree with it; `--help` imports no torch;
every eaglet command shown in README.md and docs/ parses."""

from __future__ import annotations

import dataclasses
import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet import options as O
from eaglet.cli import build_parser, resolve, stage_parsers

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Keywords of entry functions that are not options: how a caller drives the stage, not what it does.
NOT_OPTIONS = {"command", "show_progress", "progress", "progress_bar", "write_threads", "backoff",
               "workers_per_file"}
# The eval keywords that DecodeSettings fills in itself rather than the user.
NOT_SETTINGS = {"eos_ids", "pass_costs"}
NOT_OPTIONS_OF = {"convert": {"workers"}}  # writer threads: sized by convert itself
DEMO_OUT = ("demo", "out")  # the demo's own folder, where `run` names it after the recipe


def entry_defaults(stage: O.Stage) -> dict[str, object]:
    """Keyword -> default of the stage's entry function and of the config it forwards options to."""
    skip = NOT_OPTIONS | NOT_OPTIONS_OF.get(stage.name, set())
    params = {n: p.default for n, p in inspect.signature(resolve(stage.entry)).parameters.items()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n not in skip}
    if stage.config:
        fields = dataclasses.fields(resolve(stage.config))
        params |= {f.name: f.default if f.default is not dataclasses.MISSING else (
                   f.default_factory if isinstance(f.default_factory, O.Declared) else f.default_factory())
                   for f in fields if f.name not in NOT_SETTINGS}
    return params


@pytest.mark.parametrize("name", list(O.STAGES))
def test_declarations_match_the_entry_functions(name):
    stage = O.STAGES[name]
    params = entry_defaults(stage)
    declared = {o.key: o for o in stage.options if not o.cli_only}
    fixed = {"spec"} if name == "demo" else set()  # demo is `run` of the built-in recipe "demo"
    assert set(declared) == set(params) - fixed, (
        f"{name}: declared but not taken {sorted(set(declared) - set(params))}; "
        f"taken but not declared {sorted(set(params) - set(declared) - fixed)}")
    for key, o in declared.items():
        want = params[key]
        if want is inspect.Parameter.empty or o.required or (name, key) == DEMO_OUT:
            continue  # the command line always passes it
        if want is O.DECLARED or isinstance(want, O.Declared):
            want = O.declared_default(name if name != "demo" else "run", key)  # what a caller leaving it out gets
        if o.invert:
            assert want is True, f"{name} {key}: an inverted flag's keyword defaults to True"
            continue
        if isinstance(want, tuple):
            want = list(want)
        same = o.default == want or (o.kind == O.FLAG and want is False) or (o.kind == O.BOOL and want is None) or (
            o.kind == O.APPEND and want is None)
        assert same, (
            f"{name} --{o.name}: declared default {o.default!r}, the entry function's {want!r}")


@pytest.mark.parametrize("name", list(O.STAGES))
def test_no_entry_function_writes_a_default_of_its_own(name):
    """Every option an entry function takes defaults to DECLARED (the declaration's, looked up),
    and every option a config dataclass takes to `declared(...)`: no default is written twice."""
    stage = O.STAGES[name]
    declared = {o.key for o in stage.options if not o.cli_only}
    written = {k: v for k, v in entry_defaults(stage).items()
               if k in declared and v is not inspect.Parameter.empty and v is not O.DECLARED
               and not isinstance(v, O.Declared) and not (name == "demo" and k == "out")}
    assert written == {}, f"{name}: defaults written in the entry function or its config: {written}"


def test_help_never_types_a_default():
    """The default is said by help_text() from the declaration, so the two cannot drift."""
    for stage in O.STAGES.values():
        for o in stage.options:
            if o.default not in (None, False, []):
                assert "default" not in o.help, f"{stage.name} --{o.name}: '(default ...)' typed into the help"


def test_the_parser_is_the_declarations():
    parser = build_parser()
    for name, sub in stage_parsers(parser).items():
        stage = O.STAGES[name]
        dests = {a.dest: a for a in sub._actions if a.dest != "help"}
        assert set(dests) == {o.name for o in stage.options}
        for o in stage.options:
            a = dests[o.name]
            if o.kind == O.VALUE and not o.positional:
                assert a.default == o.default and tuple(a.choices or ()) == tuple(o.choices or ())
                assert a.option_strings == [o.flag] and a.required == o.required


def test_recipe_validation_uses_the_declarations():
    from eaglet.recipe import option_types

    for name in O.RECIPE_STAGES:
        assert set(option_types(name)) == set(O.STAGES[name].recipe_options())


def test_help_imports_no_torch():
    code = ("import sys\nfrom eaglet.cli import main\n"
            f"for argv in [['--help']] + [[s, '--help'] for s in {list(O.STAGES)!r}]:\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def docs_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


TABLE = re.compile(r"<!-- options: (\w+) -->\n(.*?)\n<!-- /options -->", re.S)


def test_docs_option_tables_are_generated_from_the_declarations():
    """`python scripts/update_docs.py` rewrites them; a hand edit or a new option fails here."""
    seen = set()
    for page in docs_pages():
        for name, table in TABLE.findall(page.read_text()):
            assert table == O.markdown_table(O.STAGES[name]), f"{page}: the option table of {name} is stale"
            seen.add(name)
    assert seen == set(O.STAGES), f"stages without an option table in docs/: {sorted(set(O.STAGES) - seen)}"


def shown_commands(text: str) -> list[list[str]]:
    """The argument lists of every `eaglet ...` (or `-m eaglet.cli ...`) command in a page's code blocks."""
    commands = []
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang not in ("", "bash", "sh", "console"):
            continue
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            for part in re.split(r"&&|;|\|", line):
                words = shlex.split(part)
                for i, w in enumerate(words):
                    if w in ("eaglet", ".venv/bin/eaglet", "./.venv/bin/eaglet") or (
                            w == "eaglet.cli" and i and words[i - 1] == "-m"):
                        commands.append(words[i + 1:])
                        break
    return commands


def test_every_command_shown_in_the_docs_parses():
    parser = build_parser()
    count = 0
    for page in docs_pages():
        for argv in shown_commands(page.read_text()):
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"{page.relative_to(ROOT)}: `eaglet {shlex.join(argv)}` does not parse (exit {e.code})")
            count += 1
    assert count >= 20  # the pages do show commands


def test_device_presets_fill_what_is_not_given():
    """The draft shapes are choices per kind of device (presets.toml); an option given wins."""
    from eaglet.evaluate import DecodeSettings

    cpu, cuda = DecodeSettings(), DecodeSettings(preset="cuda")
    assert (cpu.depth, cpu.top_k, cpu.total_tokens, cpu.chain_depth) == (4, 2, 6, 2)
    assert (cuda.depth, cuda.top_k, cuda.total_tokens, cuda.chain_depth) == (7, 10, 60, 3)
    assert DecodeSettings(preset="cuda", chain_depth=2).chain_depth == 2
    assert set(O.PRESETS) == {"cpu", "cuda"} and all(set(p) == {"eval"} for p in O.PRESETS.values())
    with pytest.raises(ValueError, match=r"--preset 'tpu': choose one of cpu, cuda \(presets.toml\)"):
        DecodeSettings(preset="tpu")
    args = build_parser().parse_args(["eval", "RUN", "--preset", "cuda", "--depth", "5"])
    assert (args.preset, args.depth, args.top_k) == ("cuda", 5, None)


def with_default(monkeypatch, stage: str, name: str, value: object) -> None:
    """The declaration of `stage --name` with another default, for the rest of a test."""
    old = O.STAGES[stage]
    options = tuple(dataclasses.replace(o, default=value) if o.name == name else o for o in old.options)
    monkeypatch.setitem(O.STAGES, stage, dataclasses.replace(old, options=options))


def test_a_default_changed_in_the_declaration_changes_the_cli_the_recipe_and_the_entry_function(monkeypatch):
    """Defaults are written once: change one in options.py and every consumer follows."""
    from eaglet.recipe import option_types, validate

    with_default(monkeypatch, "extract", "batch_tokens", 1234)
    assert build_parser().parse_args(["extract", "--prepared", "P", "--out", "O"]).batch_tokens == 1234
    assert O.declared_default("extract", "batch_tokens") == 1234
    seen = {}

    @O.takes_options("extract")
    def entry(prepared: str = O.DECLARED, batch_tokens: int = O.DECLARED, command: str = "") -> None:
        seen.update(batch_tokens=batch_tokens)

    entry("P")
    assert seen == {"batch_tokens": 1234}
    entry("P", batch_tokens=5)  # a value given wins
    assert seen == {"batch_tokens": 5}
    with pytest.raises(TypeError, match="needs prepared"):  # a required option has no default to fall back on
        entry()
    with_default(monkeypatch, "train", "lr", 0.125)  # a config dataclass field follows its declaration too
    from eaglet.training.config import TrainConfig
    assert TrainConfig().lr == 0.125
    # The recipe validation types a value from the declaration: an option without a default takes None.
    recipe = {"recipe": {"name": "r"}, "extract": {"batch_tokens": None}}
    with pytest.raises(ValueError, match="batch_tokens"):
        validate(recipe)
    with_default(monkeypatch, "extract", "batch_tokens", None)
    assert option_types("extract")["batch_tokens"] == int | None
    validate(recipe)


def test_every_declared_default_of_a_real_entry_function_is_looked_up(monkeypatch, tmp_path):
    """The real entry functions take the declaration at call time (not a copy made at import)."""
    from eaglet.prepare import prepare

    with_default(monkeypatch, "prepare", "data", str(tmp_path / "no-such-chats.jsonl"))
    with pytest.raises(Exception, match="no-such-chats.jsonl"):
        prepare(out=tmp_path / "out")


CITED_TEST = re.compile(r"\b(test_\w+)(?:::(test_\w+)(\[[^\]]*\])?)?")


def cited_tests(text: str) -> list[tuple[str, str | None]]:
    """(test file, test name or None) of every `test_file::test_name` a page cites; a bare
    `test_name` after a cited file (`(test_x::test_a, test_b)`) belongs to that file."""
    cited, current = [], None
    for group in re.findall(r"\(([^()]*\btest_\w+[^()]*)\)", text):
        current = None
        for file_or_name, name, _ in CITED_TEST.findall(group):
            if name:
                current = file_or_name
                cited.append((current, name))
            elif current is not None and not list((ROOT / "tests").rglob(f"{file_or_name}.py")):
                cited.append((current, file_or_name))
            else:
                current = file_or_name
                cited.append((current, None))
    return cited


def test_the_readmes_peer_table_cites_tests_that_exist():
    """Each claim of the README's peer table names the test behind it; a renamed or removed test
    (or a claim made up) fails here."""
    table = (ROOT / "README.md").read_text().split("## Which peer reads and writes what")[1].split("\n## ")[0]
    cited = cited_tests(table)
    assert len(cited) > 20
    tests = {p.stem: p for p in (ROOT / "tests").rglob("test_*.py")}
    for file, name in cited:
        path = tests.get(file)
        assert path is not None, f"README cites {file}, which is no test file"
        if name is not None:
            assert re.search(rf"^def {name}\(", path.read_text(), re.M), f"README cites {file}::{name}, which is no test"
