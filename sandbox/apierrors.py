"""The API server's own words for a failed call."""

from __future__ import annotations

import json


def api_message(exc: Exception) -> str:
    """The message of the Status the API server answered with, else the exception's text; one line."""
    body = getattr(exc, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        message = json.loads(body)["message"] if body else None
    except (ValueError, KeyError, TypeError):
        message = None
    return str(message or exc).splitlines()[0]
