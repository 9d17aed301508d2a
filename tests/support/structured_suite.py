"""The structured-outputs suite: JSON schemas, regexes, choices and an EBNF grammar, with the
prompts that ask for them. Shared by the tests and benchmarks/structured_outputs.py."""

from __future__ import annotations

import json
from typing import Any

S10 = {"type": "string", "maxLength": 10}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested-address": {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": S10, "address": {"type": "object", "properties": {"city": S10, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                 "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "bounded-array": {"type": "object", "properties": {"tags": {"type": "array", "items": S10, "minItems": 2, "maxItems": 4}},
                      "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "const": {"type": "object", "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
              "required": ["version", "ok"], "additionalProperties": False},
    "any-of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, S10]}}, "required": ["value"],
               "additionalProperties": False},
    "number-ranges": {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                      "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
                      "required": ["temperature", "humidity"], "additionalProperties": False},
    "string-pattern": {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
                       "required": ["phone"], "additionalProperties": False},
    "string-lengths": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 5}},
                       "required": ["code"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 10},
                 "first": S10}, "required": ["middle_name", "first"], "additionalProperties": False},
    "optional-props": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000}, "b": S10},
                       "required": ["a"], "additionalProperties": False},
    "array-of-objects": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "label": {"type": "string", "maxLength": 8}},
        "required": ["id", "label"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    "top-level-array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 3},
    "booleans-and-numbers": {"type": "object", "properties": {"is_capital": {"type": "boolean"},
                             "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
                             "required": ["is_capital", "population_millions"], "additionalProperties": False},
    "number-enum": {"type": "object", "properties": {"rating": {"enum": [1, 2, 3, 4, 5]}}, "required": ["rating"],
                    "additionalProperties": False},
    "matrix": {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["matrix"], "additionalProperties": False},
    "one-of-pets": {"type": "object", "properties": {"pet": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["kind", "lives"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "breed": S10},
         "required": ["kind", "breed"], "additionalProperties": False}]}}, "required": ["pet"], "additionalProperties": False},
    "date-pattern": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                     "required": ["date"], "additionalProperties": False},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                                 "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"], "additionalProperties": False},
    "exclusive-bounds": {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]},
                         "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}},
                         "required": ["level", "count"], "additionalProperties": False},
    "deep-nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "object", "properties": {"d": {"type": "string", "maxLength": 5}}, "required": ["d"], "additionalProperties": False}},
        "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "long-fixed-keys": {"type": "object", "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 9999},
        "customer_preferred_contact_method": {"enum": ["email", "telephone", "postal_mail"]},
        "customer_account_is_currently_active": {"type": "boolean"}},
        "required": ["customer_identification_number", "customer_preferred_contact_method",
                     "customer_account_is_currently_active"], "additionalProperties": False},
}

REGEXES = {
    "yes-no-because": r"(yes|no), because [a-z ]{5,30}\.",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "iso-date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
}

CHOICES = {
    "sentiment": ["positive", "negative", "neutral"],
    "capital": ["Paris", "Lyon", "Marseille", "Pari"],
}

# Arithmetic over small integers; the test parses outputs with its own little parser.
EBNF = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]?
"""


def json_prompt(name: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Answer with a JSON value ({name}) that follows this schema: "
                                        f"{json.dumps(schema)}"}]


def text_prompt(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": what}]
