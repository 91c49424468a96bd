"""The ensemble worker: ``queries`` in, answers and experience out (``core``: the strategies; ``app``: the process)."""
