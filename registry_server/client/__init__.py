"""The client side: the Python client, the `toolreg` command line, the MCP bridge."""
