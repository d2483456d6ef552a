"""Turning pydantic validation errors into one clear line for a human."""

from __future__ import annotations

from pydantic import ValidationError


def describe_validation_error(error: ValidationError, prefix: str = "") -> str:
    """``"messages.0.role: Input should be 'system', ...; temperature: ..."``.

    Unknown fields read ``unknown field 'foo'``; errors raised by our own
    validators lose pydantic's "Value error, " noise.
    """
    parts = []
    for item in error.errors(include_url=False):
        loc = ".".join(str(p) for p in item["loc"] if not _is_union_tag(p))
        loc = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        if item["type"] == "extra_forbidden":
            field = loc.rsplit(".", 1)
            where = f" in {field[0]}" if len(field) == 2 else ""
            parts.append(f"unknown field '{field[-1]}'{where}")
            continue
        msg = item["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(_dedupe(parts))


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (
        part in {"str", "TextPart", "ImagePart", "FilePart"} or "[" in part
    )


def _dedupe(items: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in items if not (x in seen or seen.add(x))]
