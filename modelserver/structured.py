"""Constrained decoding, described as plain data: what a request's output must look like.

The API layer turns ``response_format``, the vLLM-style ``guided_*`` fields and a forced
``tool_choice`` into a :data:`Constraint`; an OpenVINO engine hands it to
``GenerationConfig.structured_output_config`` through :func:`ov_structured_output` (XGrammar
underneath), the fake engine reads it to write a matching answer.

JSON schemas become a compact EBNF grammar (:func:`schema_grammar`) where they use only the
common keywords (types, properties/required, enum/const, anyOf, $ref, items/min/maxItems,
min/maxLength, small integer ranges): that grammar allows at most one space after ``,``
and ``:`` and no other whitespace, so even a weak model cannot pad the answer with
whitespace until ``max_tokens``. Objects get only their listed properties (an answer without
extra keys is valid whether or not ``additionalProperties`` allows them); an object schema
without ``properties`` accepts any object. Schemas with anything else (``pattern``, ``format``,
``allOf``, number bounds...) go to XGrammar's own JSON-schema support unchanged.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Constraint",
    "Grammar",
    "GrammarError",
    "check_regex",
    "check_schema",
    "regex_grammar",
    "TagSpec",
    "ToolGrammar",
    "choice_grammar",
    "json_grammar",
    "ov_structured_output",
    "schema_grammar",
    "strict_tools_grammar",
    "tool_call_grammar",
]


@dataclass(frozen=True, slots=True)
class Grammar:
    """``kind`` json_schema (a JSON schema as text), regex, or ebnf (XGrammar's EBNF, root rule ``root``)."""

    kind: Literal["json_schema", "regex", "ebnf"]
    value: str
    schema: Any = None  # the JSON schema this grammar was made from, if any (for the fake engine)
    choices: tuple[str, ...] = ()  # the strings of a guided_choice (for the fake engine)


@dataclass(frozen=True, slots=True)
class TagSpec:
    """One tool call's shape: ``begin`` (which names the function), the arguments, ``end``."""

    name: str
    begin: str
    arguments: Grammar
    end: str


@dataclass(frozen=True, slots=True)
class ToolGrammar:
    """Tool calls: ``one`` of the tags, ``many`` (one or more, ``separator`` between), or ``triggered``: free
    text until ``trigger`` starts a call, which then must be one of the tags (``tool_choice: auto`` with strict
    tools); ``forced`` tells the fake engine whether a call is a must."""

    tags: tuple[TagSpec, ...]
    mode: Literal["one", "many", "triggered"] = "one"
    separator: str = "\n"
    trigger: str = ""
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode != "triggered"


Constraint = Grammar | ToolGrammar


class Unsupported(Exception):
    """A schema keyword the compact grammar does not cover."""


class GrammarError(ValueError):
    """A schema or regex that XGrammar would refuse; the message says what is wrong.

    Checked before a request reaches the pipeline: XGrammar compiles a request's grammar
    inside the pipeline's step, where an error fails every request in flight.
    """


# -- JSON schema -> EBNF ----------------------------------------------------------------------

_IGNORED = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "strict", "additionalProperties", "$defs", "definitions", "discriminator", "nullable",
})
_KEYS_BY_TYPE: dict[str, frozenset[str]] = {
    "object": frozenset({"type", "properties", "required"}),
    "array": frozenset({"type", "items", "minItems", "maxItems"}),
    "string": frozenset({"type", "minLength", "maxLength", "enum", "const"}),
    "integer": frozenset({"type", "minimum", "maximum", "enum", "const"}),
    "number": frozenset({"type", "enum", "const"}),
    "boolean": frozenset({"type", "enum", "const"}),
    "null": frozenset({"type"}),
}
_BASE_RULES = {
    "ws": '" "?',
    "value": 'object | array | string | number | "true" | "false" | "null"',
    "object": '"{" ( string ":" ws value ( "," ws string ":" ws value )* )? "}"',
    "array": '"[" ( value ( "," ws value )* )? "]"',
    "char": '[^"\\\\\\x00-\\x1f] | "\\\\" ( ["\\\\/bfnrt] | "u" [0-9a-fA-F]{4} )',
    "string": '"\\"" string-rest',
    "string-rest": '"\\"" | char string-rest',  # right recursion: XGrammar runs it ~2x faster than char*
    "integer": '"-"? ( "0" | [1-9] [0-9]{0,15} )',
    "number": 'integer ( "." [0-9]{1,16} )? ( [eE] [+-]? [0-9]{1,3} )?',
}
_MAX_ENUMERATED = 256


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_literal(value: Any) -> str:
    return _literal(json.dumps(value, ensure_ascii=False))


class _SchemaGrammar:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.rules: dict[str, str] = {}
        self.used_base: set[str] = set()

    def base(self, name: str) -> str:
        self.used_base.add(name)
        return name

    def visit(self, schema: Any) -> str:
        if schema is True or schema == {}:
            return self.base("value")
        if not isinstance(schema, dict):
            raise Unsupported(f"schema {schema!r}")
        if "$ref" in schema:
            return self._ref(schema)
        if "enum" in schema:
            return "( " + " | ".join(_json_literal(v) for v in schema["enum"]) + " )" if schema["enum"] else '"null"'
        if "const" in schema:
            return _json_literal(schema["const"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                self._only(schema, {key})
                return "( " + " | ".join(self.visit(s) for s in schema[key]) + " )"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "( " + " | ".join(self.visit({**schema, "type": k}) for k in kind) + " )"
        if kind is None:
            self._only(schema, set())
            return self.base("value")
        if kind not in _KEYS_BY_TYPE:
            raise Unsupported(f"type {kind!r}")
        self._only(schema, set(_KEYS_BY_TYPE[kind]))
        return str(getattr(self, "_" + kind)(schema))

    def _only(self, schema: dict[str, Any], allowed: set[str]) -> None:
        extra = set(schema) - allowed - _IGNORED
        if extra:
            raise Unsupported(", ".join(sorted(extra)))

    def _ref(self, schema: dict[str, Any]) -> str:
        ref = schema["$ref"]
        for prefix, key in (("#/$defs/", "$defs"), ("#/definitions/", "definitions")):
            if isinstance(ref, str) and ref.startswith(prefix):
                name = ref[len(prefix) :]
                rule = "def-" + "".join(c if c.isalnum() else "-" for c in name)
                if rule not in self.rules:
                    self.rules[rule] = ""  # reserved: a recursive schema refers to itself
                    self.rules[rule] = self.visit((self.root.get(key) or {})[name])
                return rule
        if ref == "#":
            self.rules.setdefault("root-ref", "")
            if not self.rules["root-ref"]:
                self.rules["root-ref"] = self.visit(self.root)
            return "root-ref"
        raise Unsupported(f"$ref {ref!r}")

    def _object(self, schema: dict[str, Any]) -> str:
        props: dict[str, Any] = schema.get("properties") or {}
        if not props:  # "properties": {} names none (extra keys are never generated); no "properties": any object
            closed = "properties" in schema and not schema.get("additionalProperties")
            return '"{" "}"' if closed or schema.get("additionalProperties") is False else self.base("object")
        required = [k for k in props if k in set(schema.get("required") or ())]
        optional = [k for k in props if k not in required]
        pairs = {k: f"{_literal(json.dumps(k, ensure_ascii=False) + ':')} ws {self.visit(v)}" for k, v in props.items()}
        body = ' "," ws '.join(pairs[k] for k in required)
        if body:
            tail = " ".join(f'( "," ws {pairs[k]} )?' for k in optional)
            return f'"{{" {body} {tail} "}}"'
        # no required key: any in-order subset, the first one present opening the list
        firsts = [
            pairs[k] + "".join(f' ( "," ws {pairs[o]} )?' for o in optional[i + 1 :]) for i, k in enumerate(optional)
        ]
        return '"{" ( ' + " | ".join(f"( {f} )" for f in firsts) + ' )? "}"'

    def _array(self, schema: dict[str, Any]) -> str:
        item = self.visit(schema.get("items", True))
        low = int(schema.get("minItems", 0))
        high = schema.get("maxItems")
        if high is not None:
            more = f"{{{max(low - 1, 0)},{int(high) - 1}}}"
        else:
            more = "*" if low <= 1 else f"{{{low - 1},}}"
        if high is not None and int(high) == 0:
            return '"[" "]"'
        items = f'{item} ( "," ws {item} ){more}'
        return f'"[" {items} "]"' if low >= 1 else f'"[" ( {items} )? "]"'

    def _string(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minLength"), schema.get("maxLength")
        if low is None and high is None:
            return self.base("string")
        self.base("char")
        count = f"{{{int(low or 0)},{int(high)}}}" if high is not None else f"{{{int(low or 0)},}}"
        return f'"\\"" char{count} "\\""'

    def _integer(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is None and high is None:
            return self.base("integer")
        if low is not None and high is not None and 0 <= high - low < _MAX_ENUMERATED:
            values = range(math.ceil(low), math.floor(high) + 1)
            if not values:
                raise Unsupported("no integer in the bounds")  # XGrammar's compiler says so
            return "( " + " | ".join(_json_literal(v) for v in values) + " )"
        if high is None and low is not None and low in (0, 1):
            return '( "0" | [1-9] [0-9]{0,15} )' if low == 0 else "( [1-9] [0-9]{0,15} )"
        raise Unsupported("integer bounds")

    def _number(self, schema: dict[str, Any]) -> str:
        return self.base("number")

    def _boolean(self, schema: dict[str, Any]) -> str:
        return '( "true" | "false" )'

    def _null(self, schema: dict[str, Any]) -> str:
        return '"null"'

    def text(self, root_expr: str) -> str:
        needed = set(self.used_base)
        for name in ("value", "object", "array"):
            if name in needed:
                needed |= {"value", "object", "array", "string", "number", "ws"}
        needed |= {"char", "string-rest"} if "string" in needed else set()
        needed |= {"integer"} if "number" in needed else set()
        needed.add("ws")
        lines = [f"root ::= {root_expr}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        lines += [f"{name} ::= {body}" for name, body in _BASE_RULES.items() if name in needed]
        return "\n".join(lines) + "\n"


def schema_grammar(schema: Any) -> str | None:
    """``schema`` as compact XGrammar EBNF, or None when it uses keywords beyond the common ones."""
    builder = _SchemaGrammar(schema if isinstance(schema, dict) else {})
    try:
        return builder.text(builder.visit(schema))
    except (Unsupported, KeyError, TypeError, ValueError, RecursionError):  # XGrammar's own support then
        return None


def json_grammar(schema: Any) -> Grammar:
    """The grammar of a JSON document valid for ``schema`` (compact EBNF where possible)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    check_schema(schema)
    ebnf = schema_grammar(schema)
    if ebnf is not None:
        return Grammar("ebnf", ebnf, schema)
    return Grammar("json_schema", json.dumps(schema), schema)


_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum"),
           ("minProperties", "maxProperties"))


def check_schema(schema: Any, root: Any = None, where: str = "schema") -> None:
    """:class:`GrammarError` for a schema no JSON can satisfy or that XGrammar fails on: keywords of the
    wrong kind, contradictory bounds, bad types, patterns and references."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: expected a schema object, got {json.dumps(schema)[:40]}")
    _check_keywords(schema, where)
    if "pattern" in schema:
        check_regex(schema["pattern"], f"{where}.pattern")
    if "$ref" in schema:
        _check_ref(schema["$ref"], root, where)
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            check_schema(sub, root, f"{where}.{key}[{i}]")
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            check_schema(sub, root, f"{where}.{key}.{name}")
    for key in ("items", "additionalProperties", "not"):
        if key in schema and not isinstance(schema[key], bool):
            check_schema(schema[key], root, f"{where}.{key}")


def _check_keywords(schema: dict[str, Any], where: str) -> None:
    def bad(key: str, what: str) -> GrammarError:
        return GrammarError(f"{where}.{key}: expected {what}, got {json.dumps(schema[key])[:40]}")

    kinds = schema.get("type", [])
    if "type" in schema and kinds == []:
        raise bad("type", "a type or a non-empty list of types")
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind not in _TYPES:
            raise GrammarError(f"{where}.type: {json.dumps(kind)} is not one of {', '.join(sorted(_TYPES))}")
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise bad("enum", "a non-empty list")
    if "required" in schema and not (isinstance(schema["required"], list)
                                     and all(isinstance(k, str) for k in schema["required"])):
        raise bad("required", "a list of property names")
    for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMA_MAPS):
        kind, what = (list, "a non-empty list of schemas") if key in _SUBSCHEMA_LISTS else (dict, "a mapping")
        if key in schema and not (isinstance(schema[key], kind) and (kind is dict or schema[key])):
            raise bad(key, what)
    for key in _NUMBERS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int | float)):
            raise bad(key, "a number")
    for key in _COUNTS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int) or schema[key] < 0):
            raise bad(key, "an integer >= 0")
    for low, high in _BOUNDS:
        if low in schema and high in schema and schema[low] > schema[high]:
            raise GrammarError(f"{where}: {low} {schema[low]} is above {high} {schema[high]}; no value fits")


def _check_ref(ref: Any, root: Any, where: str) -> None:
    node = _resolve(ref, root, where)
    seen = set()
    while isinstance(node, dict) and "$ref" in node and not set(node) - _IGNORED - {"$ref"}:
        if id(node) in seen:  # {"$ref": "#"}: the grammar builder recursed until Python's limit, a 500
            raise GrammarError(f"{where}.$ref: {ref} leads back to itself through references alone; "
                               "a schema must describe a value")
        seen.add(id(node))
        node = _resolve(node["$ref"], root, where)


def _resolve(ref: Any, root: Any, where: str) -> Any:
    node = root
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise GrammarError(f"{where}.$ref: only local references (#/$defs/...) are supported")
    for part in [p for p in ref[1:].split("/") if p]:
        if not isinstance(node, dict) or part not in node:
            raise GrammarError(f"{where}.$ref: {ref} does not resolve in this schema")
        node = node[part]
    return node


#: What XGrammar's regex converter refuses, found in the pattern with its escapes taken out (``\\x`` -> ``_``):
#: group modifiers other than ``(?:`` (lookarounds, flags, named and atomic groups, conditionals), empty
#: alternatives, ``{,n}``, possessive quantifiers; and in the raw pattern: backreferences, word boundaries.
_REGEX_REFUSED = re.compile(r"\(\?(?!:)|^\||\|$|\(\||\|\)|\|\||\{,|[*+?}]\+")
_REGEX_REFUSED_ESCAPES = re.compile(r"\\(?:[1-9bB]|k<)")


def check_regex(pattern: Any, where: str = "regex") -> None:
    """:class:`GrammarError` unless ``pattern`` is a regex XGrammar compiles (no lookaround, backreference,
    group flag, word boundary, possessive quantifier or empty alternative)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"{where}: expected a non-empty regular expression")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # Python's notes on nested sets: not our concern
            re.compile(pattern)
    except re.error as exc:
        raise GrammarError(f"{where}: not a valid regular expression: {exc}") from None
    unescaped = re.sub(r"\\.", "_", pattern)
    if _REGEX_REFUSED.search(unescaped) or _REGEX_REFUSED_ESCAPES.search(pattern):
        raise GrammarError(
            f"{where}: lookarounds, group flags, backreferences, word boundaries, possessive quantifiers, "
            "{,n} and empty alternatives are not supported"
        )


def regex_grammar(pattern: str) -> Grammar:
    check_regex(pattern)
    return Grammar("regex", pattern)


def choice_grammar(choices: list[str]) -> Grammar:
    return Grammar("ebnf", "root ::= " + " | ".join(_literal(c) for c in choices) + "\n", choices=tuple(choices))


# -- tool calls -------------------------------------------------------------------------------


def _call_tag(parser: str, name: str, parameters: Any) -> TagSpec:
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    args = json_grammar(parameters if isinstance(parameters, dict) else no_arguments)
    quoted = json.dumps(name, ensure_ascii=False)
    if parser == "hermes":
        return TagSpec(name, f'<tool_call>\n{{"name": {quoted}, "arguments": ', args, "}\n</tool_call>")
    key = "parameters" if parser == "llama3_json" else "arguments"
    return TagSpec(name, f'{{"name": {quoted}, "{key}": ', args, "}")


def tool_call_grammar(parser: str, functions: list[dict[str, Any]], parallel: bool) -> ToolGrammar:
    """A forced call of one of ``functions`` (OpenAI ``function`` objects) in ``parser``'s form.

    Hermes calls are ``<tool_call>`` blocks one per line; the other families write the bare
    JSON call (``;`` between several), which their parsers accept too.
    """
    tags = tuple(_call_tag(parser, f["name"], f.get("parameters")) for f in functions)
    return ToolGrammar(tags, "many" if parallel else "one", "\n" if parser == "hermes" else ";", parallel=parallel)


def strict_tools_grammar(parser: str, functions: list[dict[str, Any]], parallel: bool) -> ToolGrammar | None:
    """``tool_choice: auto`` with ``strict`` functions: free text, but a call once begun matches its schema.

    Only for Hermes, whose calls open with a marker (``<tool_call>``); the bare-JSON families
    have no marker that tells a call from text, so they stay unconstrained.
    """
    if parser != "hermes" or not any(f.get("strict") for f in functions):
        return None
    tags = tuple(_call_tag(parser, f["name"], f.get("parameters")) for f in functions)
    return ToolGrammar(tags, "triggered", trigger="<tool_call>", parallel=parallel)


# -- OpenVINO ---------------------------------------------------------------------------------


def _ov_grammar(so: Any, grammar: Grammar) -> Any:
    if grammar.kind == "ebnf":
        return so.EBNF(grammar.value)
    if grammar.kind == "regex":
        return so.Regex(grammar.value)
    return so.JSONSchema(grammar.value)


def ov_structured_output(constraint: Constraint) -> Any:
    """``constraint`` as an ``openvino_genai.StructuredOutputConfig``."""
    import openvino_genai as ov_genai

    so = ov_genai.StructuredOutputConfig
    if isinstance(constraint, Grammar):
        key = {"ebnf": "grammar", "regex": "regex", "json_schema": "json_schema"}[constraint.kind]
        return so(**{key: constraint.value})
    tags = [so.Tag(t.begin, _ov_grammar(so, t.arguments), t.end) for t in constraint.tags]
    if constraint.mode == "many":
        return so(structural_tags_config=so.TagsWithSeparator(tags, constraint.separator, at_least_one=True))
    if constraint.mode == "triggered":
        triggered = so.TriggeredTags([constraint.trigger], tags, at_least_one=False,
                                     stop_after_first=not constraint.parallel)
        return so(structural_tags_config=triggered)
    return so(structural_tags_config=tags[0] if len(tags) == 1 else so.Union(tags))
