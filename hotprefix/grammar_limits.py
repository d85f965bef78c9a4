"""What a request's output constraint may be, checked before anything compiles it: sizes
that bound the work of compiling (and of building its token masks), each refused with a
400 that names the limit. The compiler's own budget (grammar_sandbox.py) stops what
slips under these and is still slow; these give the common cases a clear message at
once. Defaults follow OpenAI's structured-output limits where they have one (5,000
object properties, 1,000 enum values, nesting); the flags of `hotprefix serve` change
them (docs/server.md). Pure Python, no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hotprefix.errors import InvalidRequestError


@dataclass(frozen=True)
class GrammarLimits:
    """max_spec_bytes: a schema, regex or grammar's UTF-8 size. max_properties: object
    properties in a schema, all objects together. max_enum_values: enum and const values,
    all together. max_depth: nesting of a schema's objects and arrays. max_repeat: the
    product of counted repetitions ({n}, {n,m}) nested in one regex, schema patterns
    included."""

    max_spec_bytes: int = 128 << 10
    max_properties: int = 5_000
    max_enum_values: int = 1_000
    max_depth: int = 32
    max_repeat: int = 10_000

    def check(self, kind: str, spec: str) -> None:
        """Raises InvalidRequestError (param: the constraint's kind) naming the first
        limit `spec` exceeds."""
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > self.max_spec_bytes:
            raise _over(kind, f"is {size:,} bytes", f"{self.max_spec_bytes:,} bytes", "--max-grammar-bytes")
        if kind == "regex":
            self._check_regex(kind, spec)
        elif kind == "json_schema":
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError:
                return  # the compiler says what is wrong with it
            counts = _Counts()
            self._walk(kind, schema, 1, counts)

    def _walk(self, kind: str, node: Any, depth: int, n: _Counts) -> None:
        if depth > self.max_depth:
            raise _over(kind, f"nests more than {self.max_depth} levels deep", f"{self.max_depth} levels",
                        "--max-grammar-depth")
        if isinstance(node, list):
            for x in node:
                self._walk(kind, x, depth + 1, n)
            return
        if not isinstance(node, dict):
            return
        props = node.get("properties")
        if isinstance(props, dict):
            n.properties += len(props)
            if n.properties > self.max_properties:
                raise _over(kind, f"has more than {self.max_properties:,} object properties",
                            f"{self.max_properties:,}", "--max-grammar-properties")
        values = (len(node["enum"]) if isinstance(node.get("enum"), list) else 0) + ("const" in node)
        n.enum_values += values
        if n.enum_values > self.max_enum_values:
            raise _over(kind, f"has more than {self.max_enum_values:,} enum and const values",
                        f"{self.max_enum_values:,}", "--max-grammar-enum-values")
        if isinstance(node.get("pattern"), str):
            self._check_regex(kind, node["pattern"])
        for key, value in node.items():
            if key not in ("enum", "const", "pattern", "description", "title", "examples", "default"):
                self._walk(kind, value, depth + 1, n)

    def _check_regex(self, kind: str, regex: str) -> None:
        product = repeat_product(regex)
        if product > self.max_repeat:
            raise _over(kind, f"repeats nested counted parts {product:,} times", f"{self.max_repeat:,}",
                        "--max-grammar-repeat")


@dataclass
class _Counts:
    properties: int = 0
    enum_values: int = 0


def _over(kind: str, what: str, limit: str, flag: str) -> InvalidRequestError:
    return InvalidRequestError(f"the {kind} constraint {what}; this server's limit is {limit} ({flag})", kind)


_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def repeat_product(regex: str) -> int:
    """The largest product of counted repetitions ({n}, {n,}, {n,m}: the larger bound)
    nested around any part of `regex`: how many copies of it a compiler may unroll
    ((a{1000}){1000}: 1,000,000). Escapes and character classes count as single parts; an
    unbalanced regex is measured as far as it goes."""
    stack = [1]  # per open group: the largest product inside it so far
    last = 1  # the product of the part just read, which a quantifier would multiply
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            last, i = 1, i + 2
        elif c == "[":
            j = regex.find("]", i + 2)
            last, i = 1, (len(regex) if j < 0 else j + 1)
        elif c == "(":
            stack.append(1)
            last, i = 1, i + 1
        elif c == ")" and len(stack) > 1:
            inside = stack.pop()
            stack[-1] = max(stack[-1], inside)
            last, i = inside, i + 1
        elif c == "{" and (m := _COUNTED.match(regex, i)):
            last = last * max(int(m.group(1)), int(m.group(2) or 0), 1)
            stack[-1] = max(stack[-1], last)
            i = m.end()
        else:
            last, i = 1, i + 1
    return max(stack)
