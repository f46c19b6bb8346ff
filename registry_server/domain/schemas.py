"""Export tool definitions in the formats LLM APIs take, and as plain text."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any

from registry_server.domain.egress import describe_reach
from registry_server.domain.models import ToolDefinition


class SchemaFormat(enum.Enum):
    OPENAI = "openai"  # [{"type":"function","function":{"name","description","parameters"}}]
    ANTHROPIC = "anthropic"  # [{"name","description","input_schema"}]
    MCP = "mcp"  # [{"name","description","inputSchema"}]

    @classmethod
    def parse(cls, text: str) -> SchemaFormat:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(
                f"unknown schema format {text!r}; use openai, anthropic or mcp"
            ) from None


def export(tools: Sequence[ToolDefinition], fmt: SchemaFormat) -> list[dict[str, Any]]:
    return [_one(tool, fmt) for tool in tools]


def _one(tool: ToolDefinition, fmt: SchemaFormat) -> dict[str, Any]:
    if fmt is SchemaFormat.OPENAI:
        return {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            },
        }
    key = "input_schema" if fmt is SchemaFormat.ANTHROPIC else "inputSchema"
    return {"name": tool.name, "description": tool.description, key: tool.parameters}


def export_json(tools: Sequence[ToolDefinition], fmt: SchemaFormat) -> str:
    return json.dumps(export(tools, fmt), ensure_ascii=False, separators=(",", ":"))


def tool_json(tool: ToolDefinition, fmt: SchemaFormat) -> str:
    """One tool's schema as JSON text: ``export_json`` of several is these,
    joined by commas inside brackets (``json_array``)."""
    return json.dumps(_one(tool, fmt), ensure_ascii=False, separators=(",", ":"))


def json_array(items: Sequence[str]) -> str:
    """A JSON array of JSON texts, as ``export_json`` writes it."""
    return "[" + ",".join(items) + "]"


def tool_belt(tools: Sequence[ToolDefinition]) -> str:
    """A plain-text list of the tools for a system prompt."""
    if not tools:
        return "No tools are available.\n"
    lines = ["You can call these tools. Arguments are one JSON object.", ""]
    for tool in tools:
        params = tool.parameters
        props: dict[str, Any] = params.get("properties", {})
        required = set(params.get("required", []))
        lines.append(f"- {tool.name} [{tool.safety_level.value}]: {tool.description.strip()}")
        if tool.egress or tool.secrets:
            reach, secrets = describe_reach(tool.egress, tool.secrets)
            lines.append(f"    reaches: {reach}; secrets (held by the server): {secrets}")
        for pname, pschema in props.items():
            ptype = pschema.get("type", "any") if isinstance(pschema, dict) else "any"
            if isinstance(ptype, list):
                ptype = "|".join(str(t) for t in ptype)
            need = "required" if pname in required else "optional"
            desc = pschema.get("description", "") if isinstance(pschema, dict) else ""
            lines.append(f"    - {pname} ({ptype}, {need})" + (f": {desc}" if desc else ""))
    return "\n".join(lines) + "\n"
