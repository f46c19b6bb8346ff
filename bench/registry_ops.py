"""Registry operations with many registered tools, over loopback: the
RegisterTool rate, then ListTools, GetToolSchemas (OpenAI) and GetTool
interleaved, p50/p95 per RPC. The listings are asked for every tool in one
page (page_size 1,000, the server's maximum page), so their figures are the
whole listing's; ListTools' default page (100 tools) is timed as well."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import Any

from bench.common import Server, definition, summary, timed_ms
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb

N_TOOLS = 1_000  # tools registered before the reads are timed
CATEGORIES = ("files", "web", "math", "text", "data", "code", "time", "system")


def tool_definitions(n: int) -> list[pb.Tool]:
    """n distinct, realistic definitions: a sentence of description, three
    typed parameters (one required), one or two categories, 1 in 10 cautious."""
    tools = []
    for i in range(n):
        params = {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": f"what tool {i} works on"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10},
                "mode": {"type": "string", "enum": ["fast", "thorough"]},
            },
            "required": ["query"],
            "additionalProperties": False,
        }
        cats = [CATEGORIES[i % len(CATEGORIES)], CATEGORIES[(i * 7 + 3) % len(CATEGORIES)]]
        tools.append(
            definition(
                f"bench_tool_{i:04d}",
                level="cautious" if i % 10 == 9 else "safe",
                description=f"Benchmark tool number {i}: looks up a query and returns"
                " at most `limit` results as JSON.",
                parameters=params,
                categories=sorted(set(cats)),
            )
        )
    return tools


def register_many(srv: Server, n: int) -> dict[str, Any]:
    tools = tool_definitions(n)  # built before the clock starts
    latencies = []
    started = time.perf_counter()
    for tool in tools:
        request = pb.RegisterToolRequest(tool=tool, replace=True)
        latencies.append(timed_ms(functools.partial(srv.stub.RegisterTool, request, timeout=60)))
    elapsed = time.perf_counter() - started
    return {
        "tools": n,
        "seconds": round(elapsed, 2),
        "tools_per_s": round(n / elapsed, 1),
        **summary(latencies),
    }


def reads(srv: Server, n_tools: int, runs: int) -> dict[str, Any]:
    rng = random.Random(5)
    list_req = pb.ListToolsRequest(page_size=n_tools)
    first_page_req = pb.ListToolsRequest()
    schema_req = pb.GetToolSchemasRequest(format=pb.SCHEMA_FORMAT_OPENAI, page_size=n_tools)
    listed = srv.stub.ListTools(list_req, timeout=60)
    schemas = srv.stub.GetToolSchemas(schema_req, timeout=60)
    if len(listed.tools) < n_tools or listed.next_page_token:
        raise RuntimeError(f"ListTools returned {len(listed.tools)} tools, expected {n_tools}")
    sizes = {
        "ListTools": listed.ByteSize(),
        "ListTools, default page": srv.stub.ListTools(first_page_req, timeout=60).ByteSize(),
        "GetToolSchemas (OpenAI)": schemas.ByteSize(),
        "GetTool": srv.stub.GetTool(pb.GetToolRequest(name="bench_tool_0000")).ByteSize(),
    }
    calls: dict[str, Callable[[], object]] = {
        "ListTools": lambda: srv.stub.ListTools(list_req, timeout=60),
        "ListTools, default page": lambda: srv.stub.ListTools(first_page_req, timeout=60),
        "GetToolSchemas (OpenAI)": lambda: srv.stub.GetToolSchemas(schema_req, timeout=60),
        "GetTool": lambda: srv.stub.GetTool(
            pb.GetToolRequest(name=f"bench_tool_{rng.randrange(n_tools):04d}"), timeout=60
        ),
    }
    for fn in calls.values():  # connection, caches, first serialisation
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):  # interleaved
        for name, fn in calls.items():
            samples[name].append(timed_ms(fn))
    rows = [
        {"rpc": name, "runs": len(vals), "response_bytes": sizes[name], **summary(vals)}
        for name, vals in samples.items()
    ]
    return {"rows": rows, "samples_ms": {k: [round(v, 3) for v in s] for k, s in samples.items()}}


def p50(section: dict[str, Any], rpc: str) -> float | None:
    for row in section.get("reads", {}).get("rows", []):
        if row["rpc"] == rpc:
            return float(row["p50_ms"])
    return None
