"""The fields and types every sample of one write must have (`SampleSchema`).

The writer infers a schema from the first sample, or takes one given, and checks every later
sample against it, naming the sample number and the field on a mismatch. Fields named ``__*__``
are metadata and are not stored, except ``__key__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardloader.errors import SchemaError
from shardloader.format.schema import arrow_type, infer_type, needs_large, value_fits
from shardloader.format.tar import KEY_FIELD


def is_meta_field(name: str) -> bool:
    """True for metadata fields (``__url__``, ``__index__`` ...) that are never stored."""
    return name != KEY_FIELD and len(name) > 4 and name.startswith("__") and name.endswith("__")


def _describe(value: Any) -> str:
    try:
        return f"a value of type {infer_type(value)}"
    except SchemaError as e:
        return f"an unstorable value ({e})"


class SampleSchema:
    """The fields and type names every sample must match."""

    def __init__(self, types: Mapping[str, str]) -> None:
        if not types:
            raise SchemaError("the schema has no fields")
        for field, name in types.items():
            if not isinstance(field, str) or not field:
                raise SchemaError(f"field name {field!r} must be a non-empty string")
            try:
                arrow_type(name)
            except SchemaError as e:
                raise SchemaError(f"field {field!r}: {e}") from None
        if KEY_FIELD in types and types[KEY_FIELD] != "string":
            raise SchemaError(f"field {KEY_FIELD!r} must be of type string, not {types[KEY_FIELD]}")
        self.types = dict(types)

    @classmethod
    def infer(cls, sample: Any, number: int = 0) -> SampleSchema:
        """The schema of `sample` (sample `number` of the input, for messages)."""
        if not isinstance(sample, Mapping):
            raise SchemaError(f"sample {number}: expected a dict of fields, got {type(sample).__name__}")
        types = {}
        for field, value in sample.items():
            if not isinstance(field, str):
                raise SchemaError(f"sample {number}: field name {field!r} is not a string")
            if is_meta_field(field):
                continue
            try:
                types[field] = infer_type(value)
            except SchemaError as e:
                raise SchemaError(f"sample {number}: field {field!r}: {e}") from None
        if not types:
            raise SchemaError(f"sample {number}: has no fields to store")
        return cls(types)

    def check(self, sample: Any, number: int) -> dict[str, Any]:
        """The stored fields of `sample`, or SchemaError naming sample `number` and the field."""
        if not isinstance(sample, Mapping):
            raise SchemaError(f"sample {number}: expected a dict of fields, got {type(sample).__name__}")
        values = {k: v for k, v in sample.items() if not (isinstance(k, str) and is_meta_field(k))}
        if values.keys() != self.types.keys():
            missing = [f for f in self.types if f not in values]
            extra = [f for f in values if f not in self.types]
            raise SchemaError(
                f"sample {number}: fields differ from the schema (missing {missing}, "
                f"unexpected {extra})"
            )
        for field, value in values.items():
            if not value_fits(value, self.types[field]):
                raise SchemaError(
                    f"sample {number}: field {field!r} holds {_describe(value)}, but the schema "
                    f"type is {self.types[field]}"
                )
        return values


def large_fields(values: Mapping[str, Any], schema: SampleSchema) -> frozenset[str]:
    """The fields of a sample's `values` that need a large Arrow column (over 2 GiB)."""
    return frozenset(f for f, v in values.items() if needs_large(v, schema.types[f]))
