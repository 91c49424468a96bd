"""The pool configuration: which models a worker ensembles and how to reach each (a JSON file, typed).

```json
{"models": [
  {"name": "llama-8b", "backend": "openai", "cost": 8, "options": {"base_url": "http://llama-8b:8000/v1", "model": "llama-8b"}},
  {"name": "arith-char", "backend": "transformers", "cost": 0.1, "options": {"path": "~/.cache/rlens/zoo/arith-char"}}
]}
```

``backend`` is a registered backend name; ``cost`` its cost in the pool's units (what the Decider and budgets count);
``price`` (optional, ``{"input": 0.15, "output": 0.6}`` per million tokens) what its tokens cost in money, which
answers report in ``usage``; ``options`` are its constructor's options. For ``transformers`` they are
``path`` (and optional ``gguf_file``, ``device``), loaded with :meth:`TransformersBackend.load`; for ``replay``,
``dataset`` (a dataset directory) and ``model`` (index or name). ``openai`` options
not given fall back to the settings (``RLENS_HTTP_*``). The model order of the file is the pool's model order.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable, get_type_hints
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from rlens.backends.base import BACKENDS, Backend, create_backend
from rlens.settings import settings


class Price(BaseModel):
    """What a model's tokens cost in money (any currency, the same for the whole pool), per million tokens."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(ge=0, description="per million tokens the model reads")
    output: float = Field(ge=0, description="per million tokens the model writes")

    def of(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input + completion_tokens * self.output) / 1e6


class PoolModel(BaseModel):
    name: str = Field(min_length=1)
    backend: str
    cost: float = Field(1.0, gt=0)
    price: Price | None = Field(None, description="its tokens' price in money: answers report what each call cost")
    options: dict = Field(default_factory=dict)

    @field_validator("backend")
    @classmethod
    def _known(cls, backend: str) -> str:
        if backend not in BACKENDS and backend != "transformers":
            raise ValueError(f"unknown backend {backend!r}; known: {', '.join(sorted({*BACKENDS, 'transformers'}))}")
        return backend

    @model_validator(mode="after")
    def _options(self) -> "PoolModel":
        valid, required = backend_options(self.backend)
        if unknown := sorted(set(self.options) - valid):
            raise ValueError(
                f"model {self.name!r}: unknown option(s) {', '.join(unknown)} for backend {self.backend}; its options: {', '.join(sorted(valid))}"
            )
        if missing := sorted(required - set(self.options)):
            raise ValueError(f"model {self.name!r}: backend {self.backend} needs option(s) {', '.join(missing)}")
        if problems := option_errors(self.backend, self.options):
            raise ValueError(f"model {self.name!r}: " + "; ".join(problems))
        return self


# options whose pool-file form is a path that build_backend loads, where the constructor takes what was loaded
FILE_FORM: dict[str, dict[str, type]] = {"transformers": {"path": Path}, "replay": {"dataset": Path}}


def _constructor(backend: str) -> tuple[Callable, list[inspect.Parameter]]:
    """What builds a pool entry of ``backend`` (its constructor, or ``TransformersBackend.load``) and the parameters
    a pool file may give it."""
    if backend == "transformers":
        from rlens.backends.hf import TransformersBackend

        target: Callable = TransformersBackend.load
        skip = {"cls", "dtype"}  # dtype is no JSON value
    else:
        target, skip = BACKENDS[backend].__init__, {"self"}
    target = inspect.unwrap(target)  # a constructor under pydantic's validate_call
    parameters = [
        p
        for name, p in inspect.signature(target).parameters.items()
        if name not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return target, parameters


def backend_options(backend: str) -> tuple[set[str], set[str]]:
    """(every option, the required ones) a pool entry of ``backend`` may give: its constructor's parameters."""
    _, parameters = _constructor(backend)
    return {p.name for p in parameters}, {p.name for p in parameters if p.default is p.empty}


def option_errors(backend: str, options: dict) -> list[str]:
    """Every option of ``options`` that its constructor's type and bounds refuse (all of them, not the first)."""
    target, parameters = _constructor(backend)
    hints = get_type_hints(target, include_extras=True)
    fields: dict = {
        p.name: (
            FILE_FORM.get(backend, {}).get(p.name, hints.get(p.name, Any)),
            ... if p.default is p.empty else p.default,
        )
        for p in parameters
    }
    try:
        create_model(f"{backend}_options", __config__=ConfigDict(protected_namespaces=()), **fields).model_validate(
            options
        )
    except ValidationError as exc:
        return [f"option {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return []


class PoolConfig(BaseModel):
    models: list[PoolModel] = Field(min_length=1)
    recorded: Path | None = Field(
        None,
        description="a recorded dataset with its questions (questions.jsonl): a question it holds, asked of a model it "
        "recorded under the same name, is answered from the recording (the workers' output cache)",
    )

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[PoolModel]) -> list[PoolModel]:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return models


class PoolConfigError(ValueError):
    pass


def load_pool_config(path: Path) -> PoolConfig:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PoolConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as exc:
        raise PoolConfigError(f"{path}: not valid JSON ({exc})") from None
    return parse_pool_config(data, str(path))


def parse_pool_config(data: object, where: str) -> PoolConfig:
    """A pool from its JSON-like form (a pool file's, or the configuration file's [[pool.models]])."""
    try:
        return PoolConfig.model_validate(data)
    except ValidationError as exc:  # every problem at once
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()]
        raise PoolConfigError(f"{where}: " + "; ".join(problems)) from None


def build_backend(model: PoolModel) -> Backend:
    """The backend of one pool entry (loads local models; opens the HTTP client of remote ones)."""
    if model.backend == "transformers":
        from rlens.backends.hf import TransformersBackend

        options = dict(model.options)
        return TransformersBackend.load(Path(options.pop("path")).expanduser(), **options)
    if model.backend == "replay":
        from rlens.records.dataset import load_dataset

        return create_backend(
            "replay", **{**model.options, "dataset": load_dataset(Path(model.options["dataset"]).expanduser())}
        )
    if model.backend == "openai":
        s = settings()
        defaults = {"timeout_s": s.http.timeout_s, "retries": s.http.retries, "max_concurrency": s.http.max_concurrency}
        return create_backend("openai", **{**defaults, **model.options})
    return create_backend(model.backend, **model.options)


def build_rlae_decoder(config: PoolConfig, top_k: int = 5):
    """The token ensemble of a pool for RLAE: all `transformers` models decode in process (``TokenEnsemble``); all
    `openai` servers decode over their top-k next tokens (``TopKEnsemble``). Any other pool is a :class:`PoolConfigError`."""
    from rlens.rlae.decode import TokenEnsemble
    from rlens.rlae.topk import TopKEnsemble

    kinds = {m.backend for m in config.models}
    if kinds not in ({"transformers"}, {"openai"}):
        raise PoolConfigError(
            f"an RLAE pool is all `transformers` models (in process) or all `openai` servers (top-k), got {', '.join(sorted(kinds))}"
        )
    backends: list = [build_backend(m) for m in config.models]  # all TransformersBackend, or all OpenAIBackend
    return TokenEnsemble(backends) if kinds == {"transformers"} else TopKEnsemble(backends, top_k)
