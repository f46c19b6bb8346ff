"""Approval of dangerous calls: requests, token checks and the decision (docs/approvals.md)."""
