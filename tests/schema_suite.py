"""JSON schemas for structured output: the suite the grammar tests sample against and the engine
benchmark compiles (benchmarks/grammar_engines.py).

``SCHEMAS`` holds (name, schema) pairs that llguidance compiles with its default options. Bounds are
small on purpose (strings of at most 24 characters, arrays of at most 4 items, bounded numbers,
``additionalProperties: false`` everywhere) so that an answer drawn from random logits ends within a
few hundred tokens. ``UNSUPPORTED`` holds (name, schema, keyword) triples llguidance refuses, with
the keyword its error names.

``sample_answer`` draws one answer for a schema from seeded gaussian logits under llguidance's mask;
the grammar test and the benchmark both call it, so the benchmark walks answers the test validated.
``format_checker`` is the format checking both validate answers with.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from datetime import datetime, time

import jsonschema
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

# Random logits under llguidance's default flexible whitespace put most of their mass on the few
# hundred whitespace tokens, so answers become pages of blanks. A model does not write like that;
# the sampler compiles with compact separators instead. The same answers are valid under the
# default grammar (the test checks it).
COMPACT = {"whitespace_flexible": False}
MAX_ANSWER_TOKENS = 400


def obj(properties: dict, optional: tuple[str, ...] = ()) -> dict:
    """An object with exactly these properties, all required except those named in ``optional``."""
    required = [name for name in properties if name not in optional]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def text(max_length: int = 16, min_length: int = 0, **extra) -> dict:
    return {"type": "string", "minLength": min_length, "maxLength": max_length, **extra}


def integer(minimum: int, maximum: int) -> dict:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> dict:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def array(items: dict, max_items: int = 4, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def enum(*values) -> dict:
    return {"enum": list(values)}


def pattern(regex: str) -> dict:
    return {"type": "string", "pattern": regex}


def fmt(name: str, max_length: int | None = None) -> dict:
    """A string ``format``; the open-ended ones (email, hostname, uri) need a length bound to end."""
    schema = {"type": "string", "format": name}
    return schema if max_length is None else {**schema, "maxLength": max_length}


DATE = pattern(r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$")
PHONE = pattern(r"^\+\d{1,3} \d{3} \d{3} \d{4}$")
SKU = pattern(r"^[A-Z]{3}-\d{4}$")
IATA = pattern(r"^[A-Z]{3}$")
COUNTRY = pattern(r"^[A-Z]{2}$")
CURRENCY = enum("EUR", "USD", "GBP", "JPY", "CHF")
COLOUR = enum("black", "white", "red", "green", "blue", "yellow", "brown", "grey", "pink", "multicolour")
ADDRESS = obj({"street": text(24), "line2": text(24), "city": text(20), "postcode": text(10, 3),
               "country": COUNTRY}, optional=("line2",))

TREE_NODE = obj({"label": text(12), "children": array({"$ref": "#/$defs/node"}, max_items=2)},
                optional=("children",))
# Three explicit levels: a recursive $ref cannot bound depth, so a bounded tree names each level.
CATEGORY_LEAF = obj({"name": text(12)})
CATEGORY_MID = obj({"name": text(12), "children": array({"$ref": "#/$defs/leaf"}, max_items=2)})

TOOLS = {
    "get_weather": obj({"location": text(24, 1), "unit": enum("celsius", "fahrenheit")}, optional=("unit",)),
    "search_web": obj({"query": text(24, 1), "max_results": integer(1, 10), "site": fmt("hostname", 24)},
                      optional=("max_results", "site")),
    "send_email": obj({"to": array(fmt("email", 24), max_items=3, min_items=1), "subject": text(24),
                       "body": text(24), "cc": array(fmt("email", 24), max_items=2)}, optional=("cc",)),
    "set_thermostat": obj({"room": text(12), "temperature": number(10, 30), "mode": enum("heat", "cool", "auto")}),
}


def tool_call(name: str) -> dict:
    return obj({"name": {"const": name}, "arguments": TOOLS[name]})


SCHEMAS: list[tuple[str, dict]] = [
    # Primitives.
    ("string", text(24)),
    ("string_min_length", text(24, 8)),
    ("integer", integer(-1000, 1000)),
    ("integer_exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("integer_multiple_of", {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}),
    ("number", number(-100, 100)),
    ("number_unit_interval", number(0, 1)),
    ("number_exclusive", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5}),
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("enum_strings", enum("low", "medium", "high")),
    ("enum_mixed", enum("auto", 0, 1.5, True, None)),
    ("const_string", {"const": "ok"}),
    ("const_object", {"const": {"version": 2, "tags": ["a", "b"]}}),
    # Nullable and unions.
    ("nullable_string", {"type": ["string", "null"], "maxLength": 16}),
    ("nullable_integer", {"type": ["integer", "null"], "minimum": 0, "maximum": 99}),
    ("nullable_ref", {"$defs": {"address": ADDRESS}, "anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]}),
    ("any_of_scalars", {"anyOf": [text(12), integer(0, 99), {"type": "boolean"}]}),
    ("any_of_objects", {"anyOf": [obj({"kind": {"const": "circle"}, "radius": number(0, 10)}),
                                  obj({"kind": {"const": "rect"}, "width": number(0, 10), "height": number(0, 10)})]}),
    ("one_of_types", {"oneOf": [text(12), integer(0, 99)]}),
    ("one_of_tagged", {"oneOf": [obj({"type": {"const": "card"}, "last4": pattern(r"^\d{4}$")}),
                                 obj({"type": {"const": "iban"}, "iban": pattern(r"^[A-Z]{2}\d{2}[A-Z0-9]{8,16}$")})]}),
    ("all_of", {"allOf": [obj({"id": integer(1, 999), "name": text(12)}), {"required": ["id", "name"]}]}),
    # Strings: patterns and formats.
    ("pattern_date", DATE),
    ("pattern_phone", PHONE),
    ("pattern_sku", SKU),
    ("pattern_hex_colour", pattern(r"^#[0-9a-f]{6}$")),
    ("pattern_semver", pattern(r"^\d{1,3}\.\d{1,3}\.\d{1,3}$")),
    ("pattern_time_hhmm", pattern(r"^([01]\d|2[0-3]):[0-5]\d$")),
    ("pattern_slug", {"type": "string", "pattern": r"^[a-z0-9]+(-[a-z0-9]+)*$", "maxLength": 24}),
    ("format_date_time", fmt("date-time")),
    ("format_date", fmt("date")),
    ("format_time", fmt("time")),
    ("format_duration", fmt("duration", 16)),
    ("format_email", fmt("email", 24)),
    ("format_hostname", fmt("hostname", 24)),
    ("format_ipv4", fmt("ipv4")),
    ("format_ipv6", fmt("ipv6", 24)),
    ("format_uuid", fmt("uuid")),
    ("format_uri", fmt("uri", 24)),
    # Arrays.
    ("array_of_integers", array(integer(0, 9))),
    ("array_min_max_items", array(text(8), max_items=4, min_items=2)),
    ("array_exactly_three", array(number(0, 1), max_items=3, min_items=3)),
    ("array_of_arrays", array(array(integer(0, 9), max_items=3), max_items=3)),
    ("array_of_objects", array(obj({"x": integer(0, 99), "y": integer(0, 99)}), max_items=3)),
    ("tuple_prefix_items", {"type": "array", "prefixItems": [text(8), integer(0, 99), {"type": "boolean"}],
                            "items": False, "minItems": 3}),
    # Objects.
    ("empty_object", obj({})),
    ("flat_object", obj({"name": text(16), "age": integer(0, 120), "active": {"type": "boolean"}})),
    ("optional_properties", obj({"id": integer(1, 9999), "nickname": text(12), "email": fmt("email", 24)},
                                optional=("nickname", "email"))),
    ("all_optional", obj({"a": integer(0, 9), "b": text(8), "c": {"type": "null"}}, optional=("a", "b", "c"))),
    ("nested_objects", obj({"user": obj({"name": text(12), "profile": obj({"bio": text(24), "age": integer(0, 120)})}),
                            "created": fmt("date-time")})),
    ("pattern_properties_map", {"type": "object", "patternProperties": {r"^[a-z]{1,8}$": integer(0, 9)},
                                "additionalProperties": False, "maxProperties": 3}),
    # References.
    ("ref_defs", {"$defs": {"address": ADDRESS},
                  "type": "object", "properties": {"billing": {"$ref": "#/$defs/address"},
                                                   "shipping": {"$ref": "#/$defs/address"}},
                  "required": ["billing", "shipping"], "additionalProperties": False}),
    ("ref_legacy_definitions", {"definitions": {"money": obj({"amount": number(0, 9999), "currency": CURRENCY})},
                                "$ref": "#/definitions/money"}),
    ("recursive_tree", {"$defs": {"node": TREE_NODE}, "$ref": "#/$defs/node"}),
    ("tree_three_levels", {"$defs": {"leaf": CATEGORY_LEAF, "mid": CATEGORY_MID},
                           **obj({"name": text(12), "children": array({"$ref": "#/$defs/mid"}, max_items=2)})}),
    # Extraction.
    ("product_photo", obj({"brand": {"type": ["string", "null"], "maxLength": 24}, "colour": COLOUR,
                           "size": {"anyOf": [enum("XS", "S", "M", "L", "XL", "XXL"), integer(20, 50), {"type": "null"}]},
                           "category": enum("shoe", "shirt", "trousers", "bag", "hat", "other"),
                           "visible_text": array(text(16), max_items=3), "confidence": number(0, 1)})),
    ("invoice", obj({"invoice_number": pattern(r"^INV-\d{4,6}$"), "issue_date": fmt("date"), "due_date": DATE,
                     "vendor": obj({"name": text(24), "vat_id": pattern(r"^[A-Z]{2}\d{8,10}$")}),
                     "line_items": array(obj({"sku": SKU, "description": text(24), "quantity": integer(1, 99),
                                              "unit_price": number(0, 9999)}), max_items=4, min_items=1),
                     "currency": CURRENCY, "total": number(0, 99999)})),
    ("receipt", obj({"merchant": text(24), "date": fmt("date"), "time": pattern(r"^([01]\d|2[0-3]):[0-5]\d$"),
                     "items": array(obj({"name": text(16), "price": number(0, 999)}), max_items=4),
                     "payment": enum("cash", "card", "mobile"), "total": number(0, 9999)})),
    ("address", ADDRESS),
    ("contact_card", obj({"name": text(24), "title": {"type": ["string", "null"], "maxLength": 24},
                          "phones": array(PHONE, max_items=2), "email": fmt("email", 24), "address": ADDRESS},
                         optional=("title", "address"))),
    ("calendar_event", obj({"title": text(24), "start": fmt("date-time"), "end": fmt("date-time"),
                            "all_day": {"type": "boolean"}, "location": {"type": ["string", "null"], "maxLength": 24},
                            "attendees": array(fmt("email", 24), max_items=3),
                            "recurrence": enum("none", "daily", "weekly", "monthly")}, optional=("location",))),
    ("ocr_table_rows", obj({"columns": array(text(12), max_items=4, min_items=1),
                            "rows": array(array({"type": ["string", "number", "null"], "maxLength": 12,
                                                 "minimum": -9999, "maximum": 9999}, max_items=4), max_items=4)})),
    ("shipping_label", obj({"tracking_number": pattern(r"^1Z[0-9A-Z]{16}$"), "carrier": enum("UPS", "DHL", "FedEx"),
                            "weight_kg": number(0, 70), "from": ADDRESS, "to": ADDRESS})),
    ("nutrition_facts", obj({"serving_g": integer(1, 500), "energy_kcal": integer(0, 2000),
                             "fat_g": number(0, 100), "sugar_g": number(0, 100), "allergens": array(
                                 enum("gluten", "milk", "egg", "nuts", "soy"), max_items=3)})),
    ("named_entities", array(obj({"text": text(24, 1), "type": enum("PERSON", "ORG", "PLACE", "DATE"),
                                  "start": integer(0, 999)}), max_items=4)),
    ("classification", obj({"label": enum("positive", "negative", "neutral"), "score": number(0, 1),
                            "reasons": array(text(24), max_items=2)})),
    ("answer_with_citations", obj({"answer": text(24), "citations": array(
        obj({"source_id": integer(1, 20), "quote": text(24)}), max_items=3), "confident": {"type": "boolean"}})),
    # Tool arguments.
    ("tool_get_weather", TOOLS["get_weather"]),
    ("tool_search_web", TOOLS["search_web"]),
    ("tool_send_email", TOOLS["send_email"]),
    ("tool_set_thermostat", TOOLS["set_thermostat"]),
    ("tool_book_flight", obj({"origin": IATA, "destination": IATA, "date": fmt("date"), "passengers": integer(1, 9),
                              "cabin": enum("economy", "premium", "business", "first"),
                              "return_date": {"anyOf": [fmt("date"), {"type": "null"}]}}, optional=("return_date",))),
    ("tool_run_query", obj({"table": enum("orders", "customers", "products"),
                            "filters": array(obj({"column": text(12), "op": enum("=", "<", ">", "like"),
                                                  "value": {"type": ["string", "number", "null"], "maxLength": 12,
                                                            "minimum": -999, "maximum": 999}}), max_items=3),
                            "limit": integer(1, 100)}, optional=("filters",))),
    ("tool_call_any", {"anyOf": [tool_call(name) for name in TOOLS]}),
]


# Found by trying each keyword; llguidance refuses rather than ignores what it cannot enforce.
UNSUPPORTED: list[tuple[str, dict, str]] = [
    ("unique_items", {"type": "array", "items": integer(0, 9), "uniqueItems": True}, "uniqueItems"),
    ("contains", {"type": "array", "items": integer(0, 9), "contains": {"const": 3}}, "contains"),
    ("not", {"not": {"type": "string"}}, "not"),
    ("if_then_else", {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}}, "if"),
    ("dependent_required", {**obj({"a": text(4), "b": text(4)}, optional=("a", "b")),
                            "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ("dependent_schemas", {**obj({"a": text(4), "b": text(4)}, optional=("a", "b")),
                           "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ("property_names", {"type": "object", "additionalProperties": integer(0, 9), "propertyNames": {"pattern": "^a"}},
     "propertyNames"),
    ("unevaluated_properties", {"type": "object", "properties": {"a": integer(0, 9)}, "unevaluatedProperties": False},
     "unevaluatedProperties"),
    ("dynamic_ref", {"$defs": {"n": {"$dynamicAnchor": "meta", "type": "integer"}}, "$dynamicRef": "#meta"},
     "$dynamicRef"),
    # Overlapping branches: exactly-one cannot be enforced token by token (coerce_one_of reads it as anyOf).
    ("one_of_overlapping", {"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
    ("format_iri", {"type": "string", "format": "iri"}, "format"),
]


LEAP_SECOND = re.compile(r":60(?=[.Z+-]|$)")


def is_rfc3339(value: str, parse) -> bool:
    # datetime rejects the leap second (:60) that RFC 3339 allows and llguidance emits.
    parse(LEAP_SECOND.sub(":59", value.upper()))
    return True


def format_checker() -> jsonschema.FormatChecker:
    """For validating answers: jsonschema's own checks for date, email, ipv4, ipv6 and uuid, and
    datetime's parsers for date-time and time (jsonschema checks those only with rfc3339-validator
    installed; without it "time" falls back to draft 3's HH:MM:SS). duration, hostname and uri stay
    unchecked."""
    checker = jsonschema.FormatChecker(formats=("date", "email", "ipv4", "ipv6", "uuid"))
    checker.checks("date-time", raises=ValueError)(lambda value: is_rfc3339(value, datetime.fromisoformat))
    checker.checks("time", raises=ValueError)(lambda value: is_rfc3339(value, time.fromisoformat))
    return checker


def seed_of(name: str) -> int:
    """A schema's sampling seed: its name's, so adding a schema leaves the others' answers alone."""
    return zlib.crc32(name.encode())


@dataclass
class SampledAnswer:
    token_ids: list[int]  # EOS excluded
    stop_reason: str  # llguidance's: NoExtension (grammar complete), EndOfSentence (EOS drawn), NotStopped (cap hit)


def sample_answer(tokenizer: llguidance.LLTokenizer, name: str, schema: dict) -> SampledAnswer:
    """One answer drawn from gaussian logits seeded by the schema's name, masked by llguidance.

    Stops when the matcher is stopped (nothing but EOS may follow), when EOS is drawn (allowed
    once the grammar accepts), or after MAX_ANSWER_TOKENS tokens.
    """
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    rng = np.random.default_rng(seed_of(name))
    bitmask = llg_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)  # [1, ceil(V / 32)] int32
    token_ids: list[int] = []
    while not matcher.is_stopped() and len(token_ids) < MAX_ANSWER_TOKENS:
        llg_numpy.fill_next_token_bitmask(matcher, bitmask)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: tokenizer.vocab_size]  # [V]
        logits = np.where(allowed, rng.standard_normal(tokenizer.vocab_size), -np.inf)
        token_id = int(np.argmax(logits))
        if not matcher.consume_token(token_id):
            raise AssertionError(f"{name}: the mask allowed token {token_id}: {matcher.get_error()}")
        if token_id == tokenizer.eos_token:
            break
        token_ids.append(token_id)
    return SampledAnswer(token_ids, matcher.stop_reason())
