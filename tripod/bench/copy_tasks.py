"""The ``copy`` dataset: chat prompts whose answers reuse much of the prompt.

Rewrite-with-typos-fixed, rename-a-variable-in-this-function, reverse-this-list, repeat-and-
summarize: the traffic where speculative decoding that drafts from the prompt (ngram lookup)
pays most, and a fair test for draft models too (the answer is predictable).

Text comes from what is installed, never from a download: prose from the standard library's
module docstrings, code from its pure-Python functions (``inspect.getsource``). Both are fixed for
a given Python version, so with a seed the prompts are the same run after run.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import random
import re
import textwrap
from collections.abc import Callable
from typing import Any

_PROSE_MODULES = (
    "argparse", "json", "textwrap", "collections", "unittest", "logging", "pathlib", "dataclasses", "asyncio",
    "difflib", "heapq", "bisect", "functools", "itertools", "shlex", "statistics", "string", "csv", "email",
    "sqlite3", "zipfile", "pickle", "random", "decimal", "fractions", "contextlib", "abc", "enum", "typing",
    "base64", "tempfile", "shutil", "glob", "codecs", "io", "queue", "threading", "subprocess", "socket",
    "html", "uuid", "locale", "gettext", "operator", "copy", "pprint", "graphlib", "numbers", "weakref",
)
_CODE_MODULES = (
    "textwrap", "shlex", "statistics", "difflib", "heapq", "bisect", "string", "fnmatch", "glob", "calendar",
    "fractions", "colorsys", "ipaddress", "html", "base64", "quopri", "tokenize", "pprint", "gettext", "locale",
)
_LIST_ITEMS = (
    "apples", "bread", "copper wire", "a blue notebook", "two lemons", "the red umbrella", "olive oil",
    "a spare tyre", "paper clips", "green tea", "a torch", "batteries", "the old map", "sunflower seeds",
    "a wool scarf", "printer ink", "rice", "a silver key", "garden gloves", "tomatoes", "a clay pot",
    "the train tickets", "honey", "a measuring tape", "string", "envelopes", "a brass bell", "chalk",
    "walnuts", "a kite", "soap", "the spare charger", "a chess set", "sugar", "coloured pencils",
)


@functools.cache
def _paragraphs() -> tuple[str, ...]:
    """Prose paragraphs from module docstrings (code examples and tables left out)."""
    out = []
    for name in _PROSE_MODULES:
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except ImportError:
            continue
        for p in re.split(r"\n\s*\n", doc):
            p = " ".join(p.split())
            prose = sum(c.isalpha() or c in " ,.;:'-" for c in p) / max(1, len(p))
            if len(p) > 150 and ">>>" not in p and "=" not in p and prose > 0.95:
                out.append(p)
    return tuple(out)


@functools.cache
def _functions() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(source, names worth renaming) of module-level pure-Python functions, in a fixed order."""
    out = []
    for name in _CODE_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr in sorted(vars(mod)):
            fn = getattr(mod, attr)
            if not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            try:
                src = textwrap.dedent(inspect.getsource(fn))
                tree = ast.parse(src)
            except (OSError, TypeError, SyntaxError):
                continue
            if not 400 <= len(src) <= 2400:
                continue
            names = _renamable(tree)
            if names:
                out.append((src.rstrip(), names))
    return tuple(out)


def _renamable(tree: ast.Module) -> tuple[str, ...]:
    """Parameters and locals used at least twice (a rename that changes several lines)."""
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        return ()
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self", "cls"}
    stores = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    uses: dict[str, int] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name):
            uses[n.id] = uses.get(n.id, 0) + 1
    return tuple(sorted(v for v in params | stores if uses.get(v, 0) >= 2 and len(v) >= 1))


def _typos(rng: random.Random, text: str, rate: float = 0.08) -> str:
    """``text`` with about ``rate`` of its longer words misspelt (two letters swapped or one dropped)."""
    def spoil(m: re.Match[str]) -> str:
        w = m.group(0)
        if rng.random() >= rate:
            return w
        i = rng.randrange(1, len(w) - 2)
        return w[:i] + w[i + 1] + w[i] + w[i + 2:] if rng.random() < 0.5 else w[:i] + w[i + 1:]
    return re.sub(r"[A-Za-z]{5,}", spoil, text)


def _passage(rng: random.Random, fits: Callable[[str], bool]) -> str:
    """Consecutive paragraphs from a random start, as many as ``fits`` allows (at least one)."""
    paras = _paragraphs()
    i = rng.randrange(len(paras))
    text = paras[i]
    while True:
        i = (i + 1) % len(paras)
        longer = text + "\n\n" + paras[i]
        if not fits(longer):
            return text
        text = longer


def _fix_typos(rng: random.Random, fits: Callable[[str], bool]) -> str:
    head = "Rewrite the following text, fixing the typos. Reply with the corrected text only, nothing else.\n\n"
    return head + _typos(rng, _passage(rng, lambda t: fits(head + t)))


def _repeat_and_summarize(rng: random.Random, fits: Callable[[str], bool]) -> str:
    head = ("Repeat the following text word for word, then add one sentence that summarizes it.\n\n")
    return head + _passage(rng, lambda t: fits(head + t))


def _rename(rng: random.Random, fits: Callable[[str], bool]) -> str:
    def prompt(src: str, old: str, new: str) -> str:
        return (f"Here is a Python function. Rename the variable `{old}` to `{new}` everywhere in it and return "
                f"the whole function in a Python code block, with no other change.\n\n```python\n{src}\n```")

    fns = _functions()
    fitting = [f for f in fns if fits(prompt(f[0], "x", "x"))]
    # The longest quarter of those that fit: prompts near --isl, not a few lines of code.
    fitting.sort(key=lambda f: len(f[0]))
    candidates = fitting[len(fitting) * 3 // 4:] or [min(fns, key=lambda f: len(f[0]))]
    src, names = rng.choice(candidates)
    old = rng.choice(names)
    new = rng.choice(("value", "item", "result", "current", "data", "entry", "token", "node")) + "_" + old
    return prompt(src, old, new)


def _reverse_list(rng: random.Random, fits: Callable[[str], bool]) -> str:
    head = "Repeat the following list in reverse order, one item per line, numbered as in the original.\n\n"
    items: list[str] = []
    pool = list(_LIST_ITEMS)
    rng.shuffle(pool)
    for n, item in enumerate(pool * 4, 1):
        longer = [*items, f"{n}. {item}"]
        if items and not fits(head + "\n".join(longer)):
            break
        items = longer
    return head + "\n".join(items)


TASKS: tuple[Callable[[random.Random, Callable[[str], bool]], str], ...] = (
    _fix_typos, _rename, _reverse_list, _repeat_and_summarize,
)


def copy_prompts(count: int, tokenizer: Any, isl: int, rng: random.Random) -> list[str]:
    """``count`` prompts of about ``isl`` tokens (at most; a code prompt is one whole function,
    the closest in length), cycling through the tasks."""
    def fits(text: str) -> bool:
        return len(tokenizer.encode(text, add_special_tokens=False)) <= isl
    return [TASKS[i % len(TASKS)](rng, fits) for i in range(count)]
