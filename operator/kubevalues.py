"""Values of Kubernetes objects the operator's configuration holds, checked as the API server would.

A quantity that is not one, or a probe path without its `/`, would otherwise pass the operator's
start and fail each pool's reconcile later; each type refuses it naming the value, and gives the
chart's schema the same rule. Numbers are quantities too: Helm's `--set cpuRequest=8` passes the
number 8, YAML's `cpu: 0.5` a float.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, GetCoreSchemaHandler, GetJsonSchemaHandler, WithJsonSchema
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

# A Kubernetes resource quantity that is not negative, in apimachinery's forms: a decimal number,
# then a binary suffix (Ki to Ei), a decimal one (n, u, m, k, M, G, T, P, E) or an exponent.
QUANTITY_PATTERN = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)


def number_as_text(value: object) -> object:
    # YAML's `cpu: 0.5` and Helm's `--set engine.cpuRequest=8` give numbers: quantities too.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


@dataclass(frozen=True)
class Matching:
    """Metadata of an `Annotated` text: it must match `pattern`, and is refused as "'x' is not
    <what>" rather than with the regex; the JSON schema (the chart's) carries the pattern."""

    pattern: str
    what: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        compiled = re.compile(self.pattern)

        def check(value: str) -> str:
            if not compiled.match(value):
                raise ValueError(f"{value!r} is not {self.what}")
            return value

        return core_schema.no_info_after_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        out["pattern"] = self.pattern
        return out


QUANTITY_WORDS = "a quantity (such as 500m, 2, 256Mi, 1Gi)"
Quantity = Annotated[
    str,
    BeforeValidator(number_as_text),
    Matching(QUANTITY_PATTERN, QUANTITY_WORDS),
    WithJsonSchema({"type": ["string", "number"], "pattern": QUANTITY_PATTERN, "minimum": 0}),
]
ProbePath = Annotated[str, Matching(r"^/[^\s]*$", "a URL path (starting with /)")]
# An image reference: whatever the runtime resolves, but never empty nor with whitespace.
IMAGE_PATTERN = r"^[^\s]+$"
Image = Annotated[str, Matching(IMAGE_PATTERN, "an image reference")]
# A DNS subdomain: the cluster's domain, in the names of its Services.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$"
DnsSubdomain = Annotated[str, Matching(DNS_SUBDOMAIN, "a DNS domain (such as cluster.local)")]
# A duration Envoy takes, longer than zero.
PositiveDuration = Annotated[str, Matching(r"^0*[1-9][0-9]*(ms|s)$", "a duration longer than 0 (such as 500ms, 5s)")]


def _check_resources(resources: dict[str, Any]) -> dict[str, Any]:
    """A container's resources: every request and limit a quantity, as the API server requires."""
    for section in ("requests", "limits"):
        amounts = resources.get(section)
        if amounts is None:
            continue
        if not isinstance(amounts, dict):
            raise ValueError(f"{section} must be a mapping of resource name to quantity")
        for name, amount in amounts.items():
            text = number_as_text(amount)
            if not isinstance(text, str) or not _QUANTITY.match(text):
                raise ValueError(f"{section}.{name} {amount!r} is not {QUANTITY_WORDS}")
    return resources


Resources = Annotated[dict[str, Any], AfterValidator(_check_resources)]


