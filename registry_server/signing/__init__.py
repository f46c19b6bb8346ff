"""Approver keys and approval tokens (Ed25519 JWTs): minting and verifying, no
policy, no storage.
"""
