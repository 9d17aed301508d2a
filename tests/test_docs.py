"""The docs stay true: the site builds strictly, the generated references equal a fresh generation,
and what the pages name exists — every ``--flag`` for the command it is shown with, every
repository path, the results file behind every figure of a speed table — and no page names a path
outside the repository."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

from tripod import docs_gen
from tripod.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Where a path named in a page may live: the repository, or (a module path such as
# `engine/graphs.py`, as the docstrings write them) the package.
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {".venv"}
PACKAGE_DIRS = {p.name for p in (ROOT / "tripod").iterdir() if p.is_dir() and p.name != "__pycache__"}
# Flags of commands that are not `tripod`'s, as the pages show them with those commands.
OTHER_COMMANDS = {
    "--no-deps": "pip", "--index-url": "pip", "--dry-run": "pip / benchmarks/gpu/device_check.sh",
    "--level": "python -m tripod.kernels build", "--target": "python -m tripod.kernels.gpu compile",
    "--isa": "benchmarks/peers/run_comparison.sh", "--warmup": "benchmarks/peers/run_comparison.sh",
    "--strict": "mkdocs build", "--durations": "pytest", "--check": "python -m tripod.docs_gen",
}
COMMAND = re.compile(r"\btripod\s+(chains\s+serve|chains\s+worker|serve|route|generate|chat|bench)\b")
FLAG = re.compile(r"(?<![\w=-])--[a-z][a-z0-9-]*")  # not an option inside another's value (=--x)
PATH = re.compile(r"(?<![\w/.:~$-])\.?[A-Za-z_][\w.-]*(?:/[\w.*-]+)+/?")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@cache
def _flags() -> dict[str, set[str]]:
    """Command ("serve", "chains serve", ...; "" the top level) → its option strings."""
    out: dict[str, set[str]] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        out[prefix] = {s for a in parser._actions for s in a.option_strings}
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(f"{prefix} {name}".strip(), sub)

    walk("", build_parser())
    return out


def _code_texts(text: str) -> list[str]:
    """Command-bearing text of a page: each line of a fenced block (a `\\` continuation joined to
    the next) and each inline code span."""
    out: list[str] = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        out += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += re.findall(r"`([^`]+)`", prose)
    return out


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    # NOTE: no skip without mkdocs: the test extra installs it (pip install -e '.[test]'), and a docs
    # build that silently did not run would let a broken link through.
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_the_generated_references_equal_a_fresh_generation() -> None:
    for name, text in docs_gen.pages().items():
        committed = (docs_gen.DOCS / name).read_text()
        assert committed == text, f"docs/{name} is stale: run python -m tripod.docs_gen and commit it"


def test_every_flag_exists_for_the_command_it_is_shown_with() -> None:
    flags = _flags()
    anywhere = set().union(*flags.values())
    wrong: list[str] = []
    for page in PAGES:
        text = page.read_text()
        for code in _code_texts(text):
            # Flags after `tripod CMD` belong to CMD, until the next command on the same line.
            parts = COMMAND.split(code)
            for i in range(1, len(parts), 2):
                command = " ".join(parts[i].split())
                for flag in FLAG.findall(parts[i + 1]):
                    if flag not in flags[command] and flag not in flags[""] and flag not in OTHER_COMMANDS:
                        wrong.append(f"{_page_id(page)}: tripod {command} has no {flag}")
        for flag in set(FLAG.findall(text)):
            if flag not in anywhere and flag not in OTHER_COMMANDS:
                wrong.append(f"{_page_id(page)}: no command has {flag}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _resolves(token: str, page: Path) -> bool:
    token = re.split(r"::|:(?=[A-Za-z_])", token)[0].rstrip(".,")
    module = re.sub(r"\.[A-Za-z_]\w*$", ".py", token)  # `layers/mla.Indexer`: a name in a module
    for base in (ROOT, ROOT / "tripod", page.parent):
        if "*" in token and any(base.glob(token)):
            return True
        if (base / token).exists() or (base / module).exists():
            return True
    return False


def test_every_repository_path_named_exists() -> None:
    missing: list[str] = []
    for page in PAGES:
        text = re.sub(r"https?://\S+", "", page.read_text())
        for token in set(PATH.findall(text)):
            first = token.split("/")[0]
            if first not in TOP and first not in PACKAGE_DIRS:
                continue  # not a repository path (a URL's tail, a user's own file, a ratio)
            if not _resolves(token, page):
                missing.append(f"{_page_id(page)}: {token}")
    assert not missing, "these paths do not exist:\n" + "\n".join(sorted(missing))


def test_no_page_names_a_path_outside_the_repository() -> None:
    outside = re.compile(r"(?<![\w/.-])(?:shared/|\.\./\.\./|/work/)[\w./-]*")
    found = [f"{_page_id(p)}: {m}" for p in PAGES for m in outside.findall(p.read_text())]
    # A page of docs/ may link one level up only within the repository (mkdocs would refuse it anyway).
    assert not found, "\n".join(found)


def _tables(text: str) -> list[tuple[int, list[list[str]]]]:
    """(line index of the header, rows of cells) of each Markdown table."""
    lines = text.splitlines()
    out: list[tuple[int, list[list[str]]]] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            start, rows = i, []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            out.append((start, rows))
        else:
            i += 1
    return out


def _figure_table(rows: list[list[str]]) -> bool:
    """A table of measurements: most of its cells past the first column are figures."""
    cells = [c for row in rows for c in row[1:] if c and not c.startswith("`benchmarks") and "[" not in c]
    return bool(cells) and sum(bool(re.match(r"^\*{0,2}\d", c)) for c in cells) * 2 >= len(cells)


def _results_text(path: str) -> str:
    p = ROOT / path
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in (".md", ".json", ".csv", ".txt"))
    return "\n".join(f.read_text(errors="replace") for f in files)


def test_every_figure_in_a_speed_table_names_a_results_file_that_contains_it() -> None:
    wrong: list[str] = []
    checked = 0
    for page in PAGES:
        if "reference" in page.parts:
            continue
        text = page.read_text()
        lines = text.splitlines()
        for start, rows in _tables(text):
            if not _figure_table(rows):
                continue
            checked += 1
            # The results file is named in the table or in the paragraph just above it.
            context = "\n".join(lines[max(0, start - 8):start + 2 + len(rows)])
            named = set(re.findall(r"benchmarks/results/[\w./-]*[\w/]", context))
            if not named:
                wrong.append(f"{_page_id(page)}:{start + 1}: a table of figures names no results file")
                continue
            source = "\n".join(_results_text(n) for n in named)
            for row in rows:
                for cell in row[1:]:
                    if cell.startswith(("`", "[")):
                        continue
                    for figure in re.findall(r"\d+(?:\.\d+)?", cell):
                        if not re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", source):
                            wrong.append(f"{_page_id(page)}:{start + 1}: {figure} is in none of {sorted(named)}")
    assert checked >= 3, "the speed tables were not found: the detection above is broken"
    assert not wrong, "\n".join(wrong)


def test_the_cli_reference_shows_every_option_of_every_command() -> None:
    page = (docs_gen.REFERENCE / "cli.md").read_text()
    sections = dict(re.findall(r"^## `tripod ?([^`]*)`\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S))
    for command, options in _flags().items():
        if not command:
            continue  # the top level's --log-level and --version: every command repeats or lacks them
        assert command in sections, f"tripod {command} has no section"
        shown = set(re.findall(r"`(--?[\w-]+)`", sections[command]))
        assert options - {"-h", "--help"} <= shown, f"tripod {command}: {sorted(options - shown - {'-h', '--help'})}"
