"""``python -m registry_server.client.cli``: the ``toolreg`` command."""

from registry_server.client.cli import main

main()
