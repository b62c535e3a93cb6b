"""Typed dataclass fields that carry their command line: each declared once, with its
default, help and allowed values (:func:`opt`); :func:`check` holds an instance to them,
:func:`parser` makes the flags, so a flag, its default and its help cannot drift apart, and
:func:`read_values` reads them from a JSON or TOML file, typed as the flags are."""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import math
import operator
import re
import tomllib
import types
from dataclasses import field, fields
from pathlib import Path
from typing import Any, get_type_hints

_LIMITS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<=")}


def opt(
    default: Any,
    help: str,
    choices: tuple[str, ...] = (),
    cli: bool = True,
    sep: str = "",
    **limits: float,
) -> Any:
    """A field: its default, its help text and, where fixed, its allowed values:
    ``choices``, or ``limits`` (``ge``, ``gt``, ``le``: v >= , > , <= the value);
    ``cli=False``: no flag; ``sep``: a string field of numbers joined by it (``512-256-64``),
    which a file may give as a list (``[512, 256, 64]``)."""
    meta = {"help": help, "choices": choices, "cli": cli, "limits": limits, "sep": sep}
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    """A field's flag: ``--batch-size`` for ``batch_size``."""
    return "--" + name.replace("_", "-")


def _limits_text(limits: dict[str, float]) -> str:
    return " and ".join(f"{_LIMITS[k][1]} {x:g}" for k, x in limits.items())


def check(obj: Any) -> None:
    """Each field of the dataclass instance ``obj`` among its choices, finite where a float,
    within its limits; a ValueError naming the flag otherwise (None passes)."""
    for f in fields(obj):
        v, m = getattr(obj, f.name), f.metadata
        if v is not None and m["choices"] and v not in m["choices"]:
            raise ValueError(f"{flag(f.name)} {v!r} is not one of: {', '.join(m['choices'])}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{flag(f.name)} must be a finite number, got {v}")
        if v is not None and not all(_LIMITS[k][0](v, x) for k, x in m["limits"].items()):
            raise ValueError(f"{flag(f.name)} must be {_limits_text(m['limits'])}, got {v}")


def parser(
    cls: type,
    prog: str,
    description: str,
    only: tuple[str, ...] | None = None,
    otherwise: str = "",
) -> argparse.ArgumentParser:
    """The flags of the dataclass ``cls``: one per field (but ``cli=False`` ones), typed,
    defaulted and described by the field. ``only``: these fields' flags, without defaults:
    what is parsed holds the flags given, the rest comes from ``otherwise`` (e.g. "the
    run's": a saved configuration)."""
    some = only is not None
    p = argparse.ArgumentParser(
        prog=prog, description=description, argument_default=argparse.SUPPRESS if some else None
    )
    hints, groups = get_type_hints(cls), _groups(cls, p)
    for f in fields(cls):
        if not f.metadata["cli"] or (some and f.name not in only):  # type: ignore[operator]
            continue
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in kind.__args__ if a is not type(None))
        help_text = f.metadata["help"]
        if f.metadata["choices"]:
            help_text += f" ({', '.join(f.metadata['choices'])})"
        if f.metadata["limits"]:
            help_text += f" ({_limits_text(f.metadata['limits'])})"
        if some:
            help_text += f" (default: {otherwise})"
        elif f.default not in (None, "") and "(default:" not in help_text:  # else the help says it
            help_text += f" (default: {f.default})"
        kw: dict[str, Any] = (
            {"help": help_text} if some else {"default": f.default, "help": help_text}
        )
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
        groups.get(f.name, p).add_argument(flag(f.name), **kw)
    return p


def _groups(cls: type, p: argparse.ArgumentParser) -> dict[str, Any]:
    """Where each field's flag goes in ``p``'s help: a group titled by the docstring of the
    dataclass among ``cls``'s bases that declares it, where ``cls`` inherits its fields from
    several (as ``TrainConfig`` its option groups); else ``p`` itself."""
    declaring = [k for k in reversed(cls.__mro__) if inspect.get_annotations(k)]
    if len(declaring) < 2:
        return {}
    at: dict[str, Any] = {}
    for k in declaring:
        title = (k.__doc__ or k.__name__).strip().splitlines()[0]
        group = p.add_argument_group(title)
        at.update((name, group) for name in inspect.get_annotations(k))
    return at


def read_values(cls: type, path: str) -> dict[str, Any]:
    """Values of the dataclass ``cls``'s fields from the file ``path``: a JSON object, or
    TOML (``.toml``) ``name = value`` lines; a name is a field's or its flag's (``batch_size``
    or ``batch-size``). A ValueError names the file, and the line or the name, for text that
    does not parse, an unknown name or a value of another type than the field's."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise FileNotFoundError(f"{path}: {e.strerror}") from None
    toml = path.endswith(".toml")
    try:
        raw = tomllib.loads(text) if toml else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not {'TOML' if toml else 'JSON'}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: wants an object of options, got {type(raw).__name__}")
    hints, out = get_type_hints(cls), {}
    seps = {f.name: f.metadata.get("sep", "") for f in fields(cls)}
    for key, v in raw.items():
        name = key.replace("-", "_")
        if name not in hints:
            near = difflib.get_close_matches(name, list(hints), 1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{path}: {key!r} is not an option{hint}")
        sep = seps.get(name, "")
        out[name] = _typed(_joined(v, sep, f"{path}: {key}"), hints[name], f"{path}: {key}")
    return out


def _joined(v: Any, sep: str, where: str) -> Any:
    """A file's list ``v`` of numbers as its field's string, joined by ``sep`` (a field of
    numbers: :func:`opt`); any other value as it is; a ValueError naming ``where`` for
    another list."""
    if not isinstance(v, list):
        return v
    if sep and v and all(type(x) in (int, float) for x in v):
        return sep.join(map(str, v))
    wants = f"a list of numbers or a {sep!r}-separated string" if sep else "no list"
    raise ValueError(f"{where}: wants {wants}, got {v!r}")


def _typed(v: Any, kind: Any, where: str) -> Any:
    """``v`` as a value of the field type ``kind`` (an int where a float goes), or a
    ValueError naming ``where``."""
    optional = isinstance(kind, types.UnionType)  # X | None
    if optional:
        if v is None:
            return None
        kind = next(a for a in kind.__args__ if a is not type(None))
    if kind is float and type(v) is int:
        return float(v)
    if type(v) is kind:  # (True is no int here)
        return v
    wants = kind.__name__ + (" or null" if optional else "")
    raise ValueError(f"{where}: wants {wants}, got {v!r}")


def blamed(error: ValueError, values: dict[str, Any], where: str) -> ValueError:
    """``error``, naming ``where`` (a file) if it names the flag of one of ``values`` (what
    came from there)."""
    named = [flag(k) for k in values if re.search(re.escape(flag(k)) + r"(?![\w-])", str(error))]
    return ValueError(f"{error} ({', '.join(named)}: {where})") if named else error
