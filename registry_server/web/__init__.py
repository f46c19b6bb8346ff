"""What the web programs (the MCP bridge over HTTP, the console, the witness) share:
the listener, its Host-name checks and uvicorn's set-up."""
