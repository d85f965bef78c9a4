"""OpenAI's `metadata` field as requests take it, bounded as OpenAI bounds it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds


def _bounded_metadata(v: Any) -> Any:
    """OpenAI's `metadata` (before its values are checked one by one): at most 16 pairs, keys
    of at most 64 characters, values of at most 512. Raises ValueError."""
    if isinstance(v, dict) and (len(v) > METADATA_KEYS or any(
            len(str(k)) > METADATA_KEY_CHARS or (isinstance(x, str) and len(x) > METADATA_VALUE_CHARS)
            for k, x in v.items())):
        raise ValueError(f"metadata holds at most {METADATA_KEYS} keys of at most {METADATA_KEY_CHARS} characters, "
                         f"with string values of at most {METADATA_VALUE_CHARS}")
    return v


Metadata = Annotated[dict[str, str] | None, BeforeValidator(_bounded_metadata)]
