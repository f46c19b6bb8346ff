"""`toolreg mcp`: the registry's tools as MCP tools, over stdio (bridge.py) or
Streamable HTTP (http.py), with its settings, OAuth resource-server side, progress,
and the SSE event store that lets a host resume a stream."""
