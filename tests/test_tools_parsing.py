"""The pure parts of tool calling and structured output: parsers, stream splitting, template detection, grammars."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from modelserver.engines.fake import example_of
from modelserver.structured import (
    GrammarError,
    check_regex,
    json_grammar,
    schema_grammar,
    strict_tools_grammar,
    tool_call_grammar,
)
from modelserver.tools import (
    ToolStreamSplitter,
    detect_parser,
    drop_cut_call,
    mistral_call_ids,
    parse_tool_calls,
    template_takes_tools,
)


def calls_of(parser: str, text: str) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(parser, text).calls]


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', [("f", {"a": 1})]),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
         '"arguments": "{\\"b\\": 2}"}</tool_call>', [("f", {}), ("g", {"b": 2})]),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})]),  # no closing tag at EOS
        ("llama3_json", '{"name": "f", "parameters": {"x": "y"}}', [("f", {"x": "y"})]),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
         [("f", {}), ("g", {})]),
        ("pythonic", '[f(a=1, b="two"), g()]', [("f", {"a": 1, "b": "two"}), ("g", {})]),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1]}}]', [("f", {"a": [1]})]),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}', [("f", {"a": 1})]),
        ("pythonic", '{"name": "f", "arguments": {}}', [("f", {})]),  # the constrained (bare JSON) form
    ],
)
def test_parsers_read_their_family_form(parser: str, text: str, expected: list[Any]) -> None:
    assert calls_of(parser, text) == expected


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic", "mistral"])
def test_plain_text_and_broken_calls_stay_content(parser: str) -> None:
    for text in ("The weather is fine.", '<tool_call>{"name": "f", "argu', "[1, 2, 3]", '{"a": 1}'):
        parsed = parse_tool_calls(parser, text)
        assert parsed.calls == () and parsed.content == text


def test_hermes_keeps_complete_calls_when_a_later_one_is_cut() -> None:
    parsed = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"na')
    assert [c.name for c in parsed.calls] == ["f"]
    assert parsed.content == '<tool_call>{"na'


def test_hermes_keeps_the_text_around_calls_as_content() -> None:
    parsed = parse_tool_calls("hermes", 'Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert parsed.content == "Let me check."
    assert parsed.calls[0].id.startswith("call_") and len(parsed.calls[0].id) > 10


def split(parser: str, deltas: list[str]) -> tuple[str, list[str]]:
    splitter = ToolStreamSplitter(parser)
    text, names = "", []
    for step in [*(splitter.push(d) for d in deltas), splitter.finish()]:
        text += step[0]
        names += [c.name for c in step[1]]
    assert splitter.calls_sent == len(names)
    return text, names


def test_splitter_sends_each_hermes_call_as_soon_as_it_closes() -> None:
    splitter = ToolStreamSplitter("hermes")
    assert splitter.push("<tool_call>\n{") == ("", ())
    text, calls = splitter.push('"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "g"')
    assert text == "" and [c.name for c in calls] == ["f"]
    text, calls = splitter.push(', "arguments": {"x": 1}}</tool_call>')
    assert [c.name for c in calls] == ["g"] and json.loads(calls[0].arguments) == {"x": 1}
    assert splitter.finish() == ("", ()) and splitter.calls_sent == 2


def test_splitter_passes_a_broken_call_after_good_ones_as_text() -> None:
    assert split("hermes", ['<tool_call>{"name": "f", "arguments": {}}</tool_call>', "<tool_call>{oops"]) == (
        "<tool_call>{oops", ["f"])


def test_splitter_passes_text_and_holds_a_marker_split_across_deltas() -> None:
    deltas = ["Sure", ", one moment <tool", '_call>{"name": "f", ', '"arguments": {}}</tool_call>']
    assert split("hermes", deltas) == ("Sure, one moment ", ["f"])
    assert split("hermes", ["a <to", "day"]) == ("a <today", [])


def test_splitter_holds_an_answer_that_opens_with_json_and_releases_it_when_it_is_no_call() -> None:
    assert split("llama3_json", ['{"name": "f",', ' "parameters": {}}']) == ("", ["f"])
    assert split("hermes", ['{"a":', " 1}"]) == ('{"a": 1}', [])


CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_identical_calls_in_one_answer_collapse_to_one() -> None:
    text = "\n".join([CALL_F, CALL_F, '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>', CALL_F])
    assert calls_of("hermes", text) == [("f", {"a": 1}), ("f", {"a": 2})]
    assert calls_of("llama3_json", '{"name": "g", "parameters": {}}; {"name": "g", "parameters": {}}') == [("g", {})]
    # streamed: a repeat is not sent again, whether it closes mid-stream or at the end
    assert split("hermes", [CALL_F, "\n" + CALL_F, '\n<tool_call>{"name": "f", "arguments": {"a": 1}}']) == (
        "", ["f"])


@pytest.mark.parametrize(
    ("parser", "text", "kept"),
    [
        ("hermes", CALL_F + "\n<tool", CALL_F + "\n"),
        ("hermes", CALL_F + '\n<tool_call>\n{"name": "f", "argu', CALL_F + "\n"),
        ("hermes", 'Sure. <tool_call>\n{"name": "f", "arguments": {"a"', "Sure. "),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}', '<tool_call>\n{"name": "f", "arguments": {}}'),
        ("hermes", "A plain answer cut short", "A plain answer cut short"),
        ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "param', '{"name": "f", "parameters": {}}'),
        ("llama3_json", '{"name": "f", "parameters": {"x": "a;b"', ""),
        ("llama3_json", '<|python_tag|>{"name": "f", "para', ""),
        ("mistral", 'Ok [TOOL_CALLS][{"name": "f", "arguments": {', "Ok "),
        ("pythonic", '[{"name": "f", "arguments": {"a": [1', ""),
        ("hermes", '{"a": 1, "b": [1, 2', '{"a": 1, "b": [1, 2'),  # JSON that is no call stays
    ],
)
def test_a_call_cut_by_max_tokens_is_dropped_and_complete_ones_stay(parser: str, text: str, kept: str) -> None:
    assert drop_cut_call(parser, text) == kept


def test_splitter_drops_a_cut_call_at_a_length_cut() -> None:
    for deltas in ([CALL_F, "\n<tool"], [CALL_F, '\n<tool_call>\n{"name": "f"'], ["Hi <tool"]):
        splitter = ToolStreamSplitter("hermes")
        text, names = "", []
        for step in [*(splitter.push(d) for d in deltas), splitter.finish(cut=True)]:
            text += step[0]
            names += [c.name for c in step[1]]
        assert "<tool" not in text and "{" not in text
        assert names == (["f"] if len(deltas) == 2 else [])


def test_template_detection() -> None:
    assert not template_takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert detect_parser("{{ m.content }}") == "hermes"
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_parser("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_parser('{% if tools %}{"name": ..., "parameters": ...} ipython{% endif %}') == "llama3_json"
    assert detect_parser("{% if tools %}[func_name1(params_name1=params_value1)]{% endif %}") == "pythonic"


SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "array", "items":
        {"type": "integer", "minimum": 0}, "maxItems": 2}}, "required": ["a"]},
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/P"}]}},
     "$defs": {"P": {"type": "object", "properties": {"v": {"enum": ["p", "q"]}}, "required": ["v"]}}},
    {"type": "object", "properties": {"n": {"type": ["number", "null"]}, "s": {"const": "k"}}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_common_schemas_become_compact_ebnf_and_examples_validate(schema: Any) -> None:
    grammar = json_grammar(schema)
    assert grammar.kind == "ebnf" and grammar.value.startswith("root ::= ")
    assert "ws ::= \" \"?" in grammar.value  # at most one space: no whitespace padding
    jsonschema.validate(example_of(schema), schema)


def test_uncommon_keywords_fall_back_to_the_json_schema_itself() -> None:
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}
    assert schema_grammar(schema) is None
    assert json_grammar(schema).kind == "json_schema"
    assert json.loads(json_grammar(schema).value) == schema


def test_tool_call_grammar_per_family() -> None:
    functions = [{"name": "f", "parameters": {"type": "object", "properties": {}}}, {"name": "g"}]
    hermes = tool_call_grammar("hermes", functions, parallel=False)
    assert [t.begin for t in hermes.tags] == ['<tool_call>\n{"name": "f", "arguments": ',
                                              '<tool_call>\n{"name": "g", "arguments": ']
    assert hermes.mode == "one" and hermes.tags[0].end == "}\n</tool_call>"
    llama = tool_call_grammar("llama3_json", functions, parallel=True)
    assert llama.mode == "many" and llama.separator == ";"
    assert llama.tags[0].begin == '{"name": "f", "parameters": '


def test_strict_tools_constrain_auto_calls_only_for_hermes() -> None:
    strict = [{"name": "f", "strict": True, "parameters": {"type": "object", "properties": {}}}]
    grammar = strict_tools_grammar("hermes", strict, parallel=False)
    assert grammar is not None and grammar.mode == "triggered" and not grammar.forced
    assert grammar.trigger == "<tool_call>" and grammar.tags[0].begin.startswith(grammar.trigger)
    assert strict_tools_grammar("hermes", [{"name": "f"}], parallel=False) is None  # not strict: free
    assert strict_tools_grammar("llama3_json", strict, parallel=False) is None  # no marker to trigger on


def test_mistral_history_gets_nine_character_call_ids_that_still_pair_up() -> None:
    history = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc", "type": "function",
                                                            "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "42"},
    ]
    fixed = mistral_call_ids(history)
    call_id = fixed[0]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and fixed[1]["tool_call_id"] == call_id
    assert history[0]["tool_calls"][0]["id"] == "call_abc"  # the caller's messages are left alone


# what XGrammar's regex converter (openvino_genai 2026.4) refused and accepted when each was tried on the pipeline
REFUSED = [r"(?=a)b", r"(a)\1", r"a|", r"(?i)abc", r"(?#c)a", r"(?>a)", r"\bab\b", r"a{,3}", r"a*+", r"\p{L}",
           r"(a)(?(1)b|c)", r"(a|b"]
ACCEPTED = [r"\d{3}", r"(?:ab)+", r"a{2,}", r"\w+@\w+\.com", r"^ab$", r"\d+?", r"[a-z&&[^b]]", r"\x41", r"[\w\s]",
            r"a\|b", r"[|]"]


@pytest.mark.parametrize("pattern", REFUSED)
def test_regexes_xgrammar_refuses_are_refused_first(pattern: str) -> None:
    with pytest.raises(GrammarError):
        check_regex(pattern)


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_regexes_xgrammar_compiles_pass(pattern: str) -> None:
    check_regex(pattern)


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 is above maxItems 1"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum 5 is above maximum 2"),
        ({"enum": []}, "schema.enum: expected a non-empty list"),
        ({"type": "object", "required": "a"}, "schema.required"),
        ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}, "properties.a.maxLength"),
        ({"type": "array", "items": [{"type": "string"}]}, "schema.items"),
        ({"type": []}, "schema.type"),
    ],
)
def test_schemas_no_json_satisfies_or_xgrammar_fails_on_are_refused(schema: Any, needle: str) -> None:
    """Each of these failed inside the pipeline's step (or compiled to an empty grammar) when tried."""
    with pytest.raises(GrammarError, match=re.escape(needle)):
        json_grammar(schema)
