"""The grammar-constrained requests the serving tests send (regex, JSON schema, EBNF) and their validity check."""

from __future__ import annotations

import json
import re

REGEX = r"(Yes|No), because [a-z ]{4,40}\."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
EBNF = 'root ::= "Answer: " [0-9]+ (" " [a-z]+)* "."'
PARAMS = {"regex": {"regex": REGEX}, "json_schema": {"json_schema": json.dumps(SCHEMA)}, "ebnf": {"ebnf": EBNF}}


def check_valid(feature: str, out: dict) -> None:
    """A finished grammar output is in its language (a truncated one need not be)."""
    if feature not in PARAMS or out["meta_info"]["finish_reason"]["type"] == "length":
        return
    text = out["text"]
    if feature == "regex":
        assert re.fullmatch(REGEX, text), text
    elif feature == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), text
    elif feature == "ebnf":
        assert re.fullmatch(r"Answer: [0-9]+( [a-z]+)*\.", text), text
