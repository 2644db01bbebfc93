"""Declared, checked option fields for the frozen configuration dataclasses.

Each field of a configuration dataclass (:class:`msa_fed.core.config.ClassifierConfig`,
:class:`msa_fed.core.config.SolverConfig`, the runtime's and the job file's) is declared
with :func:`option`: its default, its one-line documentation and a check.  :func:`check_fields`
runs every check (a wrong type is a ``TypeError``, a value out of range a ``ValueError``, each
naming the field) and :func:`from_mapping` builds a config from a dict (API keyword options,
a TOML table), refusing unknown keys.  ``where`` prefixes every message ("[model] ",
"classifier_options: ") so that the caller's own name for the field appears in it.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any, TypeVar

T = TypeVar("T")

_CHECK, _DOC = "check", "doc"


class Check:
    """A check of one field's value: ``__call__`` returns the (normalised) value or raises
    ``TypeError`` / ``ValueError`` with a message that completes "``name`` must be ..."."""

    expects = "a value"

    def __call__(self, value: Any) -> Any:  # pragma: no cover - every subclass overrides it
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class Number(Check):
    """A finite real number, optionally bounded (``low``/``high``, ``open_low`` for > low)."""

    def __init__(
        self, low: float | None = None, high: float | None = None, *, open_low: bool = False, open_high: bool = False
    ) -> None:
        self.low, self.high, self.open_low, self.open_high = low, high, open_low, open_high
        parts = []
        if low is not None:
            parts.append(f"{'>' if open_low else '>='} {low:g}")
        if high is not None:
            parts.append(f"{'<' if open_high else '<='} {high:g}")
        self.expects = "a number" + (" " + " and ".join(parts) if parts else "")

    def __call__(self, value: Any) -> Any:
        if not _is_number(value):
            raise TypeError(self.expects)
        value = float(value)
        ok = math.isfinite(value)
        if ok and self.low is not None:
            ok = value > self.low if self.open_low else value >= self.low
        if ok and self.high is not None:
            ok = value < self.high if self.open_high else value <= self.high
        if not ok:
            raise ValueError(self.expects)
        return value


class Integer(Check):
    """An int (not a bool, not a float), optionally >= ``low``."""

    def __init__(self, low: int | None = None) -> None:
        self.low = low
        self.expects = "an integer" + (f" >= {low}" if low is not None else "")

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(self.expects)
        value = int(value)
        if self.low is not None and value < self.low:
            raise ValueError(self.expects)
        return value


class Choice(Check):
    """One of a fixed set of strings."""

    def __init__(self, *choices: str) -> None:
        self.choices = choices
        self.expects = "one of " + ", ".join(repr(c) for c in choices)

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise TypeError(self.expects)
        if value not in self.choices:
            raise ValueError(self.expects)
        return value


class Text(Check):
    """A string; ``nonempty`` refuses ""; ``contains`` must appear in it."""

    def __init__(self, *, nonempty: bool = False, contains: str | None = None) -> None:
        self.nonempty, self.contains = nonempty, contains
        self.expects = "a non-empty string" if nonempty else "a string"
        if contains:
            self.expects += f" containing {contains!r}"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise TypeError(self.expects)
        if (self.nonempty and not value) or (self.contains and self.contains not in value):
            raise ValueError(self.expects)
        return value


class Flag(Check):
    expects = "true or false"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, bool):
            raise TypeError(self.expects)
        return value


class FlagOr(Check):
    """true, false, or one of a fixed set of strings (a flag with a conditional setting)."""

    def __init__(self, *choices: str) -> None:
        self.choices = choices
        self.expects = "true, false or " + ", ".join(repr(c) for c in choices)

    def __call__(self, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if not isinstance(value, str):
            raise TypeError(self.expects)
        if value not in self.choices:
            raise ValueError(self.expects)
        return value


class TextList(Check):
    """A list (or tuple) of non-empty strings, as a tuple; a bare string is refused (it would be
    read as a list of letters)."""

    expects = "a list of non-empty strings"

    def __call__(self, value: Any) -> Any:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(self.expects)
        if not all(isinstance(v, str) and v for v in value):
            raise TypeError(self.expects)
        return tuple(value)


class Optional(Check):
    """None, or what ``inner`` accepts."""

    def __init__(self, inner: Check) -> None:
        self.inner = inner
        self.expects = f"{inner.expects} (or unset)"

    def __call__(self, value: Any) -> Any:
        return None if value is None else self.inner(value)


class Any_(Check):
    """Anything (checked elsewhere, e.g. a feature-map object)."""

    def __init__(self, expects: str = "a value") -> None:
        self.expects = expects

    def __call__(self, value: Any) -> Any:
        return value


def option(
    default: Any = MISSING,
    doc: str = "",
    check: Check | None = None,
    *,
    default_factory: Callable[[], Any] | None = None,
    **where: Any,
) -> Any:
    """A dataclass field with its documentation and check (see the module docstring); ``where``
    says where else the field appears (read with :func:`option_meta`; e.g. the fit's tree says
    which job-file table holds it and whether the API takes it, :mod:`msa_fed.runtime.config`)."""
    meta: dict[str, Any] = {**where, _DOC: doc, _CHECK: check or Any_()}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def field_doc(cls: type, name: str) -> str:
    """The one-line documentation of field ``name`` of config class ``cls``."""
    return str(next(f.metadata.get(_DOC, "") for f in fields(cls) if f.name == name))


def option_meta(f: Field[Any], key: str, default: Any = None) -> Any:
    """What the declaration of field ``f`` says under ``key`` (an :func:`option` keyword)."""
    return f.metadata.get(key, default)


def expects(cls: type, name: str) -> str:
    """What field ``name`` of ``cls`` accepts, in words ("a number > 0")."""
    return str(next(f.metadata.get(_CHECK, Any_()).expects for f in fields(cls) if f.name == name))


def check_value(cls: type, name: str, value: Any, where: str = "", label: str | None = None) -> Any:
    """``value`` checked (and normalised) for field ``name`` of ``cls``; the message calls the
    field ``label`` (default: its name) after the ``where`` prefix."""
    check = next(f.metadata.get(_CHECK, Any_()) for f in fields(cls) if f.name == name)
    try:
        return check(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}{label or name} must be {exc}; got {value!r}") from None


def check_fields(obj: Any, where: str = "") -> dict[str, Any]:
    """Every declared field of ``obj`` checked; returns {name: normalised value} for those whose
    normalised value differs (the caller sets them, e.g. with ``object.__setattr__``)."""
    changed = {}
    for f in fields(obj):
        if _CHECK not in f.metadata:
            continue
        value = getattr(obj, f.name)
        new = check_value(type(obj), f.name, value, where)
        if new is not value:
            changed[f.name] = new
    return changed


_CHECKED = "_msa_fed_checked"


def is_checked(obj: Any) -> bool:
    """Whether ``obj`` is a configuration its ``validate()`` returned: checked once, where it
    entered; a copy made since (``dataclasses.replace``) is not, until it is validated."""
    return bool(vars(obj).get(_CHECKED, False))


def validates_once(validate: Callable[..., T]) -> Callable[..., T]:
    """A configuration's ``validate()`` that checks it once: the checked object is marked, and
    validating it again (the coordinator, the Ray sites) returns it at once."""

    @functools.wraps(validate)
    def once(self: T, *args: Any, **kwargs: Any) -> T:
        if is_checked(self):
            return self
        checked = validate(self, *args, **kwargs)
        object.__setattr__(checked, _CHECKED, True)
        return checked

    return once


def normalise(obj: T, where: str = "") -> T:
    """Check a frozen dataclass instance in place (normalised values set); returns it."""
    for name, value in check_fields(obj, where).items():
        object.__setattr__(obj, name, value)
    return obj


def unknown_keys(cls: type, mapping: Mapping[str, Any], where: str = "", exclude: tuple[str, ...] = ()) -> None:
    """ValueError naming the keys of ``mapping`` that are not fields of ``cls``."""
    allowed = sorted(f.name for f in fields(cls) if f.name not in exclude)
    extra = sorted(str(k) for k in mapping if k not in allowed)
    if extra:
        raise ValueError(f"{where}unknown key(s) {extra}; expected some of {allowed}")


def from_mapping(
    cls: type[T], mapping: Mapping[str, Any] | None, where: str = "", exclude: tuple[str, ...] = (), **base: Any
) -> T:
    """``cls(**base, **mapping)`` with unknown keys refused and every field checked."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{where}must be a mapping of options; got {mapping!r}")
    mapping = dict(mapping)
    unknown_keys(cls, mapping, where, exclude)
    values = {**base, **mapping}
    for name, value in list(values.items()):
        values[name] = check_value(cls, name, value, where)
    return cls(**values)
