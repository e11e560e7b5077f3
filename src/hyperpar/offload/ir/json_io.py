"""Versioned JSON files for the IR, with errors that name the file and the field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


class IRFormatError(ValueError):
    """A trace or schedule file (or dict) is not what the IR expects."""


def write_json(path: str | Path, kind: str, payload: dict[str, Any]) -> None:
    doc = {"format": f"hyperpar.{kind}", "version": FORMAT_VERSION, **payload}
    Path(path).write_text(json.dumps(doc, separators=(",", ":")))


def read_json(path: str | Path, kind: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise IRFormatError(f"{path}: not a text (UTF-8) file ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise IRFormatError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise IRFormatError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != f"hyperpar.{kind}":
        raise IRFormatError(
            f"{path}: format is {doc.get('format')!r}, expected 'hyperpar.{kind}'"
        )
    if doc.get("version") != FORMAT_VERSION:
        raise IRFormatError(
            f"{path}: version {doc.get('version')!r} is not supported (expected {FORMAT_VERSION})"
        )
    return doc


def field(doc: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """Fetch ``doc[name]`` checking its JSON type; bool never passes for int/float."""
    if name not in doc:
        raise IRFormatError(f"{where}: missing field {name!r}")
    value = doc[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise IRFormatError(f"{where}: field {name!r} must be {_names(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise IRFormatError(f"{where}: field {name!r} must be {_names(kinds)}, got {value!r}")
    return value


def non_negative_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise IRFormatError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


def non_negative_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise IRFormatError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise IRFormatError(f"{where}: expected a finite non-negative number, got {value!r}")
    return float(value)


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)
