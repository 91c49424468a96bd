"""``python -m rlens.cli``: the same as the ``rlens`` command."""

from rlens.cli import main

main()
