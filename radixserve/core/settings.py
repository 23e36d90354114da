"""Settings defined once: a config dataclass's field carries its command-line flag.

A field made with ``setting(default, help=..., ...)`` is a flag of every command that
takes that config (``add_flags``), named after the field unless told otherwise, typed from
its annotation, with its default and help; ``from_args`` reads the parsed flags back into
the config's keyword arguments. So ``radixserve serve``'s and ``generate``'s engine flags,
``LLM(...)``'s keywords and ``EngineConfig``'s fields are one list, and the help a user
reads is written next to the field it sets. A field made with plain ``field`` or a bare
default has no flag: a keyword only (documented where it is defined).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_FLAG = "radixserve.flag"


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    Invariant: ``name`` starts with ``--``; ``parse`` turns the flag's text into the field's
    value (the default is used as it is, unparsed); ``off`` is only for ``bool | None``
    fields (a second flag that sets ``False``; the field's flag sets ``True``)."""

    help: str | None = None
    name: str | None = None  # default: --field-name
    aliases: tuple[str, ...] = ()
    choices: Sequence[Any] | None = None
    parse: Callable[[str], Any] | None = None  # default: from the field's annotation
    metavar: str | None = None
    group: str | None = None  # the help's section (None: the config's own)
    off: str | None = None
    repeat: bool = False  # a tuple field: the flag is given once per item
    many: bool = False  # with ``repeat``: each flag may give several items (``--x A B``)
    required: bool = False  # the command refuses to run without it


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str | None = None,
    default_factory: Any = dataclasses.MISSING,
    **flag: Any,
) -> Any:
    """A dataclass field that is also a command-line flag (``Flag``'s fields as keywords)."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={_FLAG: Flag(help=help, **flag)},
    )


def flag_of(f: dataclasses.Field) -> Flag | None:
    return f.metadata.get(_FLAG)


def flag_fields(config: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of ``config`` that are flags, in definition order."""
    return [(f, fl) for f in dataclasses.fields(config) if (fl := flag_of(f)) is not None]


def _base_type(hint: Any) -> Any:
    """A field's type without ``| None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, _UnionType) and args else hint


_UnionType = type(int | None)


def flag_name(f: dataclasses.Field, fl: Flag) -> str:
    return fl.name or "--" + f.name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser,
    config: type,
    groups: dict[str | None, str] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """Add every flag of ``config`` but the fields in ``skip`` (which the command defines
    its own way) to ``parser`` (``dest`` = the field's name), in help sections by
    ``Flag.group`` (``groups`` maps a group to its title; a group not there is a section
    of that name)."""
    sections: dict[str | None, Any] = {}

    def section(name: str | None) -> Any:
        if name not in sections:
            title = (groups or {}).get(name, name)
            sections[name] = parser.add_argument_group(title) if title else parser
        return sections[name]

    hints = typing.get_type_hints(config)  # (annotations are strings here)
    for f, fl in flag_fields(config):
        if f.name in skip:
            continue
        g = section(fl.group)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        names = [flag_name(f, fl), *fl.aliases]
        kind = _base_type(hints[f.name])
        common: dict[str, Any] = {"dest": f.name, "help": fl.help}
        if kind is bool:
            if fl.off is not None:  # bool | None: two flags, one for each value
                both = g.add_mutually_exclusive_group()
                both.add_argument(*names, action="store_true", default=default, **common)
                both.add_argument(fl.off, dest=f.name, action="store_false")
            elif default is True:  # --x / --no-x
                g.add_argument(
                    *names, action=argparse.BooleanOptionalAction, default=default, **common
                )
            else:
                g.add_argument(*names, action="store_true", default=default, **common)
            continue
        if fl.repeat:
            g.add_argument(
                *names,
                action="extend" if fl.many else "append",
                nargs="+" if fl.many else None,
                default=[],
                metavar=fl.metavar,
                required=fl.required,
                **common,
            )
            continue
        parse = fl.parse or (kind if kind in (int, float, str) else None)
        if parse is None:
            raise TypeError(f"{config.__name__}.{f.name}: a flag of type {kind} needs parse=")
        metavar = fl.metavar
        if metavar is None and fl.choices is None:
            metavar = names[0].lstrip("-").replace("-", "_").upper()
        g.add_argument(
            *names,
            type=parse,
            default=default,
            choices=list(fl.choices) if fl.choices is not None else None,
            metavar=metavar,
            required=fl.required,
            **common,
        )


def from_args(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The keyword arguments of ``config`` that its flags in ``args`` set."""
    return {
        f.name: tuple(getattr(args, f.name)) if fl.repeat else getattr(args, f.name)
        for f, fl in flag_fields(config)
    }


def from_mapping(config: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """The keyword arguments of ``config`` that ``values`` sets (a config file's table),
    each key a flag's name without its dashes (``kv-cache-memory``) or a field's name
    (``kv_cache_memory_gb``), each value the flag's text or a value of the field's type (a
    list for a repeated flag; a number for a flag that parses its text means what that text
    would), within its choices. ``ValueError`` naming ``where`` (a
    file, a section) and the key for anything else."""
    hints = typing.get_type_hints(config)
    by_name: dict[str, tuple[dataclasses.Field, Flag]] = {}
    for f, fl in flag_fields(config):
        for name in (f.name, flag_name(f, fl), *fl.aliases):
            by_name[name.lstrip("-").replace("-", "_")] = (f, fl)
    out: dict[str, Any] = {}
    for key, value in values.items():
        found = by_name.get(key.lstrip("-").replace("-", "_"))
        if found is None:
            raise ValueError(f"{where}: {key!r} is not a setting")
        f, fl = found
        kind = _base_type(hints[f.name])
        try:
            if fl.repeat:
                items = value if isinstance(value, list) else [value]
                value = tuple(items if fl.parse is None else map(fl.parse, map(str, items)))
            elif fl.parse is not None and not isinstance(value, bool | list | dict):
                value = fl.parse(str(value))  # (a number means what the flag's text means)
            elif isinstance(value, str) and kind in (int, float):
                value = kind(value)
            elif kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"give a {kind.__name__}")
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{where}: {key} = {value!r}: {exc}") from None
        if fl.choices is not None and value not in fl.choices:
            raise ValueError(f"{where}: {key} = {value!r}: one of {list(fl.choices)}")
        out[f.name] = value
    return out


# -- parse helpers for flags whose text is not the field's value as it stands ----------------
def zero_is_none(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """``0`` on the command line means "none" (the field's ``None``)."""

    def parse(text: str) -> Any:
        value = kind(text)
        return None if value == 0 else value

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names it in errors
    return parse


def scaled(kind: Callable[[str], Any], factor: float, zero_none: bool = False) -> Callable:
    """A flag in another unit (milliseconds for a field in seconds: ``factor`` 1e-3)."""

    def parse(text: str) -> Any:
        value = kind(text)
        return None if zero_none and value == 0 else value * factor

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def floats(count: int) -> Callable[[str], tuple[float, ...]]:
    """``A,B,C``: exactly ``count`` comma-separated numbers."""

    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(x) for x in text.split(","))
        except ValueError:
            values = ()
        if len(values) != count:
            raise argparse.ArgumentTypeError(
                f"expected {count} comma-separated numbers; got {text!r}"
            )
        return values

    return parse
