"""Model backends behind one interface (:class:`rlens.backends.base.Backend`), registered by name.

Importing this package registers ``replay`` and ``openai``; ``transformers`` is registered when :mod:`rlens.backends.hf` is
imported (it needs the optional ``transformers`` dependency).
"""

from rlens.backends import replay  # noqa: F401  (registers "replay")
from rlens.backends import openai  # noqa: F401  (registers "openai")
from rlens.backends.base import (
    BACKENDS,
    Backend,
    BackendError,
    ChoiceQuery,
    ChoiceScores,
    GenerationRequest,
    Generations,
    create_backend,
    register_backend,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "ChoiceQuery",
    "ChoiceScores",
    "GenerationRequest",
    "Generations",
    "create_backend",
    "register_backend",
]
