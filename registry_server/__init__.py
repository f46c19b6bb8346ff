"""toolreg registry server: tool definitions over gRPC, each call run in a fresh sandbox."""

__version__ = "0.2.0"
