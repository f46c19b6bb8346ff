"""Conversions between the domain and the protobuf messages, shared by the server and the client."""
