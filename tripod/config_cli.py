"""The command line generated from the config dataclasses' field metadata (:class:`Opt`).

Three directions, one declaration per option:

- :class:`CommandParser` adds a config's options to one command's parser (its flags, type,
  default, choices, help), so ``serve``, ``generate``, ``chat``, ``route`` and ``chains serve``
  spell a shared option the same way;
- :func:`from_namespace` reads a config back from a parsed command line;
- :func:`to_argv` writes a config as command-line options again: what ``tripod serve`` passes on
  to each replica of a fleet, which parses it with the same declarations (argv → config → argv
  gives the same config back; tests/test_cli_options.py).

Generic: the configs (``tripod.config``) declare their fields with :func:`opt`; nothing here
knows a particular config. NOTE: no torch here or in ``tripod.config``: the parsers are built
before a command runs.
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Protocol, TypeVar, Union, get_args, get_origin, get_type_hints

C = TypeVar("C")

# Help group titles by key (Opt.group, CommandParser.add's group).
GROUP_TITLES = {
    "console": "console (GET /ui: live view, playground, benchmark history)",
    "fleet": "fleet (a router in front of replicas this process launches)",
    "responses": "responses (the store behind /v1/responses: previous_response_id, retrieve, delete)",
    "tracing": "tracing (OpenTelemetry spans: router -> replica -> engine; off by default)",
    "vision": "vision (images in requests to a vision-language model: limits, URL fetching)",
}


@dataclass(frozen=True, slots=True)
class Opt:
    """How a config field appears on the command line: the one declaration this module
    builds every parser from. ``commands``: the commands that take it; ``flag``: when not
    ``--field-name`` (``flags``: per command, where one command spells it differently); a bool
    field is a flag that sets the opposite of its default; ``env``: the default comes from this
    environment variable (empty = unset); ``check``: run on the raw value at parse time (a
    ValueError becomes argparse's exit 2); ``group``: a help group other than the config's own;
    ``forward``: whether ``tripod serve`` passes it on to a fleet's replicas (host and port are
    each replica's own); ``join``: the option takes several values, joined with it."""

    help: str | None = None
    commands: tuple[str, ...] = ()
    flag: str | None = None
    flags: tuple[tuple[str, str], ...] = ()
    dest: str | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    env: str | None = None
    check: Callable[[str], object] | None = None
    group: str | None = None
    forward: bool = True
    # Several values (``--flag A B`` and/or ``--flag A --flag B``) joined with this separator into
    # the field's one string (None: a single value).
    join: str | None = None
    # A bool spelled both ways (``--normalize`` / ``--no-normalize``; ``flag`` is ignored).
    negatable: bool = False
    # The value's reader when more spellings than the field type's are taken (a ValueError
    # becomes argparse's exit 2 with the reason); it returns the field's type.
    parse: Callable[[str], Any] | None = None


def opt(default: Any, help: str | None = None, **kw: Any) -> Any:
    """A dataclass field with ``default`` and its command-line :class:`Opt` (``kw``: Opt's fields)."""
    return field(default=default, metadata={"cli": Opt(help, **kw)})


class Subcommands(Protocol):
    """What ``ArgumentParser.add_subparsers`` returns: where a command's parser is added."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class ArgumentAdder(Protocol):
    """An argparse parser or argument group: where an option is added."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


@dataclass(frozen=True, slots=True)
class CliField:
    """One config field that the command line sets: its name, type hint, default and :class:`Opt`."""

    name: str
    hint: Any
    default: Any
    opt: Opt

    @property
    def dest(self) -> str:
        """The namespace attribute: shared by every config whose field has this name (see from_namespace)."""
        return self.opt.dest or self.name

    def flag(self, command: str) -> str:
        return dict(self.opt.flags).get(command) or self.opt.flag or "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.hint is bool


def cli_fields(cls: type, command: str | None = None) -> list[CliField]:
    """The fields of config class ``cls`` that carry an :class:`Opt` (those ``command`` takes, when given)."""
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        o = f.metadata.get("cli")
        if o is not None and (command is None or command in o.commands):
            out.append(CliField(f.name, hints[f.name], _default(f), o))
    return out


def _default(f: Field[Any]) -> Any:
    assert f.default is not MISSING, f"{f.name}: a command-line option needs a plain default"
    return f.default


def _scalar(hint: Any) -> Any:
    """``int | None`` → ``int``: the type argparse converts a value to (None for str: kept as given)."""
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = [a for a in get_args(hint) if a is not type(None)]
    return None if hint is str else hint


def _checked(check: Callable[[str], object], keep: bool = True) -> Callable[[str], Any]:
    """argparse's ``type`` for an :attr:`Opt.check` (the value kept as given) or an :attr:`Opt.parse`
    (``keep=False``: what it returns): a ValueError becomes argparse's exit 2 with the reason."""

    def parse(value: str) -> Any:
        try:
            out = check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value if keep else out

    return parse


class CommandParser:
    """Adds config options to one command's parser, each in its help group (``groups``: the
    order --help lists them in; others follow in the order first asked for)."""

    def __init__(self, parser: argparse.ArgumentParser, command: str, groups: tuple[str, ...] = ()) -> None:
        self.parser = parser
        self.command = command
        self.groups: dict[str, ArgumentAdder] = {}
        for key in groups:  # in this order in --help, whichever config adds to them first
            self.group(key)

    def group(self, key: str | None) -> ArgumentAdder:
        """The help group ``key`` (None: the command's own options)."""
        if key is None:
            return self.parser
        if key not in self.groups:
            self.groups[key] = self.parser.add_argument_group(GROUP_TITLES.get(key, key))
        return self.groups[key]

    def add(self, cls: type, group: str | None) -> CommandParser:
        """Every option of config ``cls`` that this command takes, in ``group`` unless its Opt names another."""
        for f in cli_fields(cls, self.command):
            self.add_field(f, self.group(f.opt.group or group))
        return self

    def add_field(self, f: CliField, where: ArgumentAdder) -> None:
        o, flag = f.opt, f.flag(self.command)
        kw: dict[str, Any] = {"dest": f.dest, "help": o.help}
        if f.is_bool and o.negatable:  # --name / --no-name
            kw.update(action=argparse.BooleanOptionalAction, default=f.default)
        elif f.is_bool:  # a flag that sets the opposite of the default
            kw["action"] = "store_false" if f.default else "store_true"
        else:
            kw["default"] = os.environ.get(o.env) if o.env else f.default
            kind = _scalar(f.hint)
            if o.parse is not None:
                kw["type"] = _checked(o.parse, keep=False)
            else:
                kw["type"] = _checked(o.check) if o.check is not None else kind
            if o.join is not None:  # every value given, in order, however many flags carry them
                kw.update(action="extend", nargs="+", default=None)
            if o.choices is not None:
                kw["choices"] = list(o.choices)
            elif o.metavar or flag != "--" + f.dest.replace("_", "-"):  # after the flag, not the dest
                kw["metavar"] = o.metavar or flag.lstrip("-").replace("-", "_").upper()  # --threads THREADS
        where.add_argument(flag, **kw)


def from_namespace(cls: type[C], ns: argparse.Namespace, **overrides: Any) -> C:
    """Config ``cls`` from a parsed command line: each field with an :class:`Opt` whose dest the
    command has (``tripod serve``'s fleet router reads --host/--port/--api-key/--bench-dir that the
    server's options declared), then ``overrides``; the rest keep their defaults. The config
    validates itself (a ValueError that says what to change)."""
    values = {f.name: _value(f, getattr(ns, f.dest)) for f in cli_fields(cls) if hasattr(ns, f.dest)}
    return cls(**{**values, **overrides})


def _value(f: CliField, value: Any) -> Any:
    if f.opt.join is not None and isinstance(value, list):
        return f.opt.join.join(value)
    # An option defaulted from the environment: an empty variable (or value) means unset.
    return None if f.opt.env and not value else value


def namespace_values(ns: argparse.Namespace, command: str, *classes: type) -> dict[str, Any]:
    """The options of ``classes`` that ``command`` takes, by dest (for a config assembled from
    several, such as ``chains serve``'s)."""
    return {f.dest: _value(f, getattr(ns, f.dest)) for cls in classes for f in cli_fields(cls, command)}


def to_argv(config: object, command: str) -> list[str]:
    """``config`` as ``command``'s options (those it forwards): a flag where a bool differs from
    its default, ``--flag value`` for every other value that is set."""
    out: list[str] = []
    for f in cli_fields(type(config), command):
        if not f.opt.forward:
            continue
        value = getattr(config, f.name)
        if f.is_bool and f.opt.negatable:
            out += [("--" if value else "--no-") + f.dest.replace("_", "-")] if value != f.default else []
        elif f.is_bool:
            out += [f.flag(command)] if value != f.default else []
        elif value is not None and value != "":
            out += [f.flag(command), str(value)]
    return out
