"""``python -m registry_server.cli``: the ``toolreg`` command."""

from registry_server.cli import main

main()
