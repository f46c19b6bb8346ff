"""Egress for sandboxes that may reach named hosts: the allow-list rules
(rules.py), the proxy that enforces them outside the sandbox (proxy.py) and
its supervision by the server (supervisor.py).

rules.py and proxy.py use the standard library only: the proxy runs in its own
container from the toolreg/python image, with this directory mounted as the
package ``egress``. Keep them free of third-party imports.
"""
