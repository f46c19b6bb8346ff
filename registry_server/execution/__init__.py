"""One tool call from request to outcome: the executor's steps, admission, warm
pools, the audit record.
"""
