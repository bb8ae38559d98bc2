"""Shared pieces of the custom resource models: base model, durations, conditions, CEL rules."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, GetCoreSchemaHandler, ValidationError
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError, core_schema

GROUP = "cacheroute.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "cacheroute.dev/v1alpha1"

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration such as `5m`, `1h30m` or `250ms`."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration such as 30s, 5m or 1h30m")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))


def _valid_duration(text: str) -> str:
    parse_duration(text)
    return text


Duration = Annotated[
    str,
    Field(pattern=DURATION_PATTERN, max_length=32, examples=["5m"]),
    AfterValidator(_valid_duration),
]


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def wire(self) -> dict[str, Any]:
        """The object as it is written to the API server (unset and empty lists omitted, as Go does)."""
        out: dict[str, Any] = _omit_empty(self.model_dump(by_alias=True, exclude_none=True, mode="json"))
        return out


def _omit_empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _omit_empty(v) for k, v in value.items() if v not in ([], {})}
    if isinstance(value, list):
        return [_omit_empty(v) for v in value]
    return value


class ObjectMeta(BaseModel):
    """The part of metadata the models read; the API server owns the rest."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = ""
    namespace: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class Condition(ApiModel):
    """Same shape as metav1.Condition."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    observed_generation: int | None = Field(default=None, ge=0)
    last_transition_time: datetime
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)


CONDITIONS_FIELD: dict[str, Any] = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule enforced twice from one definition: as CEL by the API server, in Python by us."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None

    def as_schema(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def enforce(rules: tuple[CrossFieldRule, ...], spec: Any) -> None:
    for rule in rules:
        if not rule.check(spec):
            raise ValueError(rule.message)


def int_or_words_message(lo: int | None, hi: int | None, words: list[str]) -> str:
    """What an integer-or-word field must be; the CRD's CEL rule says it in the same words."""
    if lo is not None and hi is not None:
        number = f"an integer from {lo} to {hi}"
    elif lo is not None:
        number = f"an integer of at least {lo}"
    else:
        number = "an integer"
    return f"must be {' or '.join(words)}, or {number}"


@dataclass(frozen=True)
class IntOrWords:
    """Annotates `int | Literal[...]`: an integer within bounds or one of a few words (Kubernetes'
    int-or-string, its word checked by CEL). A wrong value is one error naming it, not one per
    member of the union.
    """

    ge: int | None = None
    le: int | None = None
    words: tuple[str, ...] = ("auto",)

    @property
    def message(self) -> str:
        return int_or_words_message(self.ge, self.le, list(self.words))

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        inner = core_schema.union_schema(
            [core_schema.int_schema(ge=self.ge, le=self.le, strict=True), core_schema.literal_schema(list(self.words))]
        )
        return core_schema.no_info_wrap_validator_function(self._one_error, inner)

    def _one_error(self, value: Any, validate: core_schema.ValidatorFunctionWrapHandler) -> Any:
        try:
            return validate(value)
        except ValidationError:
            number = isinstance(value, int) and not isinstance(value, bool)
            given = str(value) if number else json.dumps(value, default=str)
            context = {"message": self.message, "given": given}
            raise PydanticCustomError("int_or_words", "{message}, not {given}", context) from None
