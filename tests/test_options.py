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
# Parameters of entry functions besides the options: how a caller drives the stage, not what it does.
NOT_OPTIONS = {"command", "show_progress", "progress", "progress_bar", "write_threads", "backoff", "workers", "given"}
# What DecodeSettings fills in itself rather than the user.
NOT_SETTINGS = {"eos_ids", "pass_costs"}


@pytest.mark.parametrize("name", list(O.STAGES))
def test_each_entry_function_takes_its_stage_options_and_no_option_of_its_own(name):
    """An entry function's first parameter is the stage's options object; its others drive the
    stage (progress, the command recorded): no option is a keyword, so no default is written twice."""
    stage = O.STAGES[name]
    params = list(inspect.signature(resolve(stage.entry)).parameters.values())
    assert params[0].default is inspect.Parameter.empty, f"{name}: the options object is required"
    hints = inspect.get_annotations(resolve(stage.entry))
    assert hints[params[0].name] == stage.config.__name__, f"{name}: takes {hints[params[0].name]}"
    others = {p.name for p in params[1:]}
    assert others <= NOT_OPTIONS, f"{name}: parameters besides the options: {sorted(others - NOT_OPTIONS)}"
    assert not others & {o.key for o in stage.options}


@pytest.mark.parametrize("name", [n for n, s in O.STAGES.items() if s.checked_by])
def test_a_stages_checked_settings_are_its_declared_options(name):
    """TrainConfig and DecodeSettings build on the declarations (options.TrainSettings,
    options.DecodeOptions): each is made from the stage's options, with the declared defaults
    (DecodeSettings only narrows the preset's fields to what they are once filled in)."""
    stage = O.STAGES[name]
    checked = resolve(stage.checked_by)
    declared = {f.name: f for f in dataclasses.fields(stage.config)}
    for f in dataclasses.fields(checked):
        if f.name in NOT_SETTINGS:
            continue
        assert f.name in declared, f"{name}: {checked.__name__}.{f.name} is no option of the stage"
        assert O.OPTION in f.metadata or f.default is None, f"{name}: {f.name} redeclared with a default of its own"


def test_the_command_lines_defaults_are_the_options_objects():
    """A Python caller who leaves an option out gets what the command line gives when it is not
    written: both read the one default of the field (inverted flags included)."""
    from eaglet.cli import stage_options

    required = {
        "prepare": ["--out", "o"],
        "extract": ["--prepared", "p", "--out", "o"],
        "convert": ["src", "--out", "o", "--layout", "v1"],
        "run": ["demo"],
        "check": ["ds"],
        "train": ["ds", "--out", "o"],
        "regen": ["--out", "o.jsonl"],
        "eval": ["ckpt"],
        "export": ["ckpt", "o", "--format", "eagle"],
        "import": ["dir", "--out", "o"],
        "demo": [],
    }
    parser = build_parser()
    for name, stage in O.STAGES.items():
        from_cli = stage_options(stage, parser.parse_args([name, *required[name]]))
        given = {
            k: getattr(from_cli, k)
            for k in [o.key for o in stage.options if (o.required or o.positional) and not o.cli_only]
        }
        assert from_cli == stage.config(**given), name


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
    code = (
        "import sys\nfrom eaglet.cli import main\n"
        f"for argv in [['--help']] + [[s, '--help'] for s in {list(O.STAGES)!r}]:\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
    )
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
                        w == "eaglet.cli" and i and words[i - 1] == "-m"
                    ):
                        commands.append(words[i + 1 :])
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


def test_a_default_changed_in_the_declaration_changes_the_cli_the_recipe_and_the_entry_function(monkeypatch):
    """Defaults are written once, in a field of the stage's options class: change one there and
    the command line, its help, the recipe validation and Python callers all follow."""
    from eaglet.recipe import option_types, validate

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Changed(O.ExtractOptions):
        batch_tokens: int | None = O.option("padded tokens per forward pass", type=int, default=1234)

    monkeypatch.setitem(O.STAGES, "extract", dataclasses.replace(O.STAGES["extract"], config=Changed))
    assert build_parser().parse_args(["extract", "--prepared", "P", "--out", "O"]).batch_tokens == 1234
    assert "(default 1234)" in O.STAGES["extract"].option("batch_tokens").help_text()
    assert Changed(prepared="P", out="O").batch_tokens == 1234
    # The recipe validation types a value from the declaration: an option without a default takes None.
    recipe = {"recipe": {"name": "r"}, "extract": {"batch_tokens": None}}
    with pytest.raises(ValueError, match="batch_tokens"):
        validate(recipe)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NoDefault(O.ExtractOptions):
        batch_tokens: int | None = O.option("padded tokens per forward pass", type=int)

    monkeypatch.setitem(O.STAGES, "extract", dataclasses.replace(O.STAGES["extract"], config=NoDefault))
    assert option_types("extract")["batch_tokens"] == int | None
    validate(recipe)


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
            assert re.search(rf"^def {name}\(", path.read_text(), re.M), (
                f"README cites {file}::{name}, which is no test"
            )
