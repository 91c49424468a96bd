"""Developer tooling, not part of a production image: ``rlens up`` (the embedded broker and Redis, the whole stack
as child processes) and ``rlens load`` (recorded traffic through a running stack)."""
