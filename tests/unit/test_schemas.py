"""Schema export formats and the plain-text tool belt."""

from __future__ import annotations

import json

import pytest

from registry_server.domain.schemas import SchemaFormat, export, export_json, tool_belt
from tests.factories import tool

PARAMS = {
    "type": "object",
    "properties": {"q": {"type": "string", "description": "query"}},
    "required": ["q"],
}


def test_openai_format() -> None:
    out = export(
        [tool(name="search", description="Finds.", parameters=PARAMS)], SchemaFormat.OPENAI
    )
    assert out == [
        {
            "type": "function",
            "function": {"name": "search", "description": "Finds.", "parameters": PARAMS},
        }
    ]


def test_anthropic_format() -> None:
    out = export(
        [tool(name="search", description="Finds.", parameters=PARAMS)], SchemaFormat.ANTHROPIC
    )
    assert out == [{"name": "search", "description": "Finds.", "input_schema": PARAMS}]


def test_mcp_format() -> None:
    out = export([tool(name="search", description="Finds.", parameters=PARAMS)], SchemaFormat.MCP)
    assert out == [{"name": "search", "description": "Finds.", "inputSchema": PARAMS}]


@pytest.mark.parametrize("fmt", list(SchemaFormat))
def test_empty_set_exports_empty_array(fmt: SchemaFormat) -> None:
    assert export_json([], fmt) == "[]"


def test_export_json_keeps_property_order() -> None:
    params = {"type": "object", "properties": {"z": {}, "a": {}}}
    text = export_json([tool(parameters=params)], SchemaFormat.MCP)
    assert list(json.loads(text)[0]["inputSchema"]["properties"]) == ["z", "a"]


def test_format_parse() -> None:
    assert SchemaFormat.parse(" Anthropic ") is SchemaFormat.ANTHROPIC
    with pytest.raises(ValueError, match="openai, anthropic or mcp"):
        SchemaFormat.parse("gemini")


def test_tool_belt_lists_tools_and_parameters() -> None:
    text = tool_belt(
        [tool(name="search", description="Finds.", parameters=PARAMS, safety_level="cautious")]
    )
    assert "- search [cautious]: Finds." in text
    assert "    - q (string, required): query" in text


def test_tool_belt_of_nothing() -> None:
    assert tool_belt([]) == "No tools are available.\n"
