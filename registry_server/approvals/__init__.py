"""Approval of dangerous calls: requests, token checks and the decision
(docs/how-to/approvals.md)."""
