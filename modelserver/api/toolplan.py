"""What a chat request asks of the output: the tools to offer, the constraint to decode under, the parsing.

``tool_choice`` ``required`` or a named function become a forced call
(:func:`~modelserver.structured.tool_call_grammar`; exactly one, or one or more for ``required``
with an explicit ``parallel_tool_calls: true``), ``auto`` with strict tools a triggered
one (Hermes only), and ``response_format`` / ``guided_*`` a grammar; what XGrammar would
refuse is a 400 here, before it reaches the pipeline.
"""

from __future__ import annotations

import json
from typing import Any

from modelserver.errors import RequestError, UnsupportedParameter
from modelserver.protocol import ChatCompletionRequest
from modelserver.structured import (
    Constraint,
    GrammarError,
    choice_grammar,
    json_grammar,
    regex_grammar,
    strict_tools_grammar,
    tool_call_grammar,
)

__all__ = ["chat_plan"]


def _output_constraint(body: ChatCompletionRequest) -> Constraint | None:
    try:
        return _constraint_of(body)
    except GrammarError as exc:
        param = next(name for name in _CONSTRAINT_FIELDS if getattr(body, name) is not None)
        raise RequestError(f"{param}: {exc}", param=param) from None


_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def _constraint_of(body: ChatCompletionRequest) -> Constraint | None:
    """``response_format`` or one of the vLLM-style ``guided_*`` fields (validated: at most one)."""
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        return json_grammar({"type": "object"})
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        return json_grammar(fmt.json_schema.schema_ or {})
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError:
                raise RequestError("guided_json: not a valid JSON schema", param="guided_json") from None
        return json_grammar(schema)
    if body.guided_regex is not None:
        return regex_grammar(body.guided_regex)
    if body.guided_choice is not None:
        return choice_grammar(body.guided_choice)
    return None


def chat_plan(body: ChatCompletionRequest, parser: str) -> tuple[tuple[dict[str, Any], ...], Constraint | None, bool]:
    """The tools to offer, the constraint to decode under, and whether to parse tool calls out of the text."""
    mode = body.tool_mode()
    if mode == "none":
        return (), _output_constraint(body), False
    if parser == "none":
        raise UnsupportedParameter(
            "tools: this model is configured with tool_parser: none and takes no tools; send no `tools` "
            "(or set the model's tool_parser)",
            param="tools",
        )
    tools = tuple(tool.model_dump(exclude_none=True) for tool in body.tools or ())
    functions = [tool["function"] for tool in tools]
    try:
        if mode == "auto":
            strict = strict_tools_grammar(parser, functions, body.parallel_tool_calls)
            return tools, _output_constraint(body) or strict, True
        forced = functions if mode == "required" else [f for f in functions if f["name"] == mode]
        # one call unless the client asked for several: the default `true` lets a weak model repeat its
        # call until max_tokens (a named function is always exactly one call)
        parallel = mode == "required" and body.parallel_tool_calls and "parallel_tool_calls" in body.model_fields_set
        return tools, tool_call_grammar(parser, forced, parallel), True
    except GrammarError as exc:
        raise RequestError(f"tools: a function's parameters: {exc}", param="tools") from None
