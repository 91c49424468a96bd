"""What the benchmarks share: arguments and JSON output (``args``), the machine's facts (``machine``), local stacks
and traffic (``stacks``)."""
