"""Fast construction of frozen slots dataclasses for the decoders' hot paths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

_T = TypeVar("_T")


def positional_constructor(cls: type[_T]) -> Callable[..., _T]:
    """A faster constructor of a frozen slots event, for the decoders' hot paths.

    A frozen dataclass's ``__init__`` stores each field with
    ``object.__setattr__(self, name, value)``, a generic attribute lookup per
    field; the function made here calls each slot's descriptor directly, which
    builds the same object in about half the time. Every field must be given,
    positionally, in declaration order (no defaults; the events have no
    ``__post_init__`` to skip).
    """
    names = [field.name for field in fields(cls)]  # type: ignore[arg-type]
    scope: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    lines = [f"def make({', '.join(names)}):", "    self = _new(_cls)"]
    for index, name in enumerate(names):
        scope[f"_set{index}"] = cls.__dict__[name].__set__
        lines.append(f"    _set{index}(self, {name})")
    lines.append("    return self")
    exec("\n".join(lines), scope)
    make: Callable[..., _T] = scope["make"]
    return make
