"""Persistence behind one interface (tools, approval requests, spent token ids,
the audit log); the SQLite implementation and an in-memory one.
"""
