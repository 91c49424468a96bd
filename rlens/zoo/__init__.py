"""The model zoo: small specialist models trained here on synthetic task families, beside the real small LLMs, and
their recorded answers (``rlens demo``'s default data)."""
