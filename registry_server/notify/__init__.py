"""Telling approvers: approval events posted to the policy's webhook
endpoints (docs/how-to/deploying.md, "Webhooks").

endpoints.py reads each endpoint's signing secret at start; outbox.py queues
one delivery per (event, endpoint) inside the event's own transaction;
payload.py shapes what is sent; dispatcher.py sends it from its own threads,
signed the Standard Webhooks way, retrying with backoff.
"""
