"""Where a server listens unless told otherwise: shared by the server's
configuration and the client's default address."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
