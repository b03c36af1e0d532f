"""Temporal's JSON payloads, with classes that read their own looser or older shapes.

A workflow's signal and update arguments arrive as the JSON an operator typed (``temporal workflow signal
--input``, the UI's "Send a Signal") or as an older Shepherd wrote them into a history that is still replayed: a
bare string where a dataclass is expected today, a field missing or of the wrong type, a continue-as-new input of
the shape it had before. The SDK refuses those, and drops a signal it cannot decode. Here, in this one place:

- a class with a ``from_wire(value)`` classmethod builds itself from any JSON value;
- a class with an ``upgrade_wire(value)`` classmethod rewrites an older JSON shape into today's, which the SDK
  then decodes as usual.

Every other type decodes as the SDK decodes it, and encoding is the SDK's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
    JSONTypeConverter,
    JSONTypeConverterUnhandled,
    value_to_type,
)

T = TypeVar("T")


class _FromWire(JSONTypeConverter):
    """Decodes a value for a class that has from_wire through it, and upgrades one for a class with upgrade_wire."""

    def __init__(self, upgraded: type | None = None) -> None:
        # The class whose value was upgraded already: decoded now as the SDK decodes it.
        self._upgraded = upgraded

    def to_typed_value(self, hint: type, value: Any) -> Any | JSONTypeConverterUnhandled | None:
        if value is None or not isinstance(hint, type):
            # null is None where the hint allows it, and refused where it does not, as the SDK decides.
            return JSONTypeConverter.Unhandled
        build = getattr(hint, "from_wire", None)
        if callable(build):
            return build(value)
        upgrade = getattr(hint, "upgrade_wire", None)
        if callable(upgrade) and hint is not self._upgraded:
            return value_to_type(hint, upgrade(value), [_FromWire(upgraded=hint)])
        return JSONTypeConverter.Unhandled


class PayloadConverter(CompositePayloadConverter):
    """The SDK's default payload converters, whose JSON one decodes through from_wire where a class has it."""

    def __init__(self) -> None:
        super().__init__(
            *(
                JSONPlainPayloadConverter(custom_type_converters=[_FromWire()])
                if isinstance(converter, JSONPlainPayloadConverter)
                else converter
                for converter in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )


# What every client, worker and replayer of Shepherd's workflows decodes with.
DATA_CONVERTER = dataclasses.replace(DataConverter.default, payload_converter_class=PayloadConverter)


def decode_json(hint: type[T], value: Any) -> T:
    """A JSON value read as hint, the way a payload of that type is decoded (through from_wire where a class has
    it); for a document that carries a workflow's answer elsewhere, such as the operator API's."""
    decoded: T = value_to_type(hint, value, [_FromWire()])
    return decoded
