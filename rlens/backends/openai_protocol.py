"""The part of the OpenAI completions API that rlens uses, as pydantic models (client and server share them).

It is the legacy ``/v1/completions`` endpoint that vLLM, SGLang and the llama.cpp server speak: ``echo`` +
``logprobs`` return the prompt's per-token log-probabilities (choice scoring), ``max_tokens=1`` + ``logprobs=k``
the top k next tokens (the RLAE top-k ensemble), ``n`` samples several completions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # servers accept (and ignore) fields they do not use

    model: str
    prompt: str | list[str] = Field(description="one prompt or a batch of prompts (text only)")
    max_tokens: int = Field(16, ge=0, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    n: int = Field(1, ge=1, le=64)
    echo: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=20, description="top tokens per position (OpenAI allows 5, vLLM 20 by default)"
    )
    stop: str | list[str] | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 only makes sense with echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list")
        return self

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class Logprobs(BaseModel):
    """Per token of the returned text: its text, log-probability (None for the first prompt token), top tokens."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]

    @model_validator(mode="after")
    def _aligned(self) -> "Logprobs":
        lengths = {len(self.tokens), len(self.token_logprobs), len(self.text_offset)}
        if self.top_logprobs is not None:
            lengths.add(len(self.top_logprobs))
        if len(lengths) != 1:
            raise ValueError(f"logprobs arrays have different lengths {sorted(lengths)}")
        return self


class CompletionChoice(BaseModel):
    index: int = Field(ge=0)
    text: str
    logprobs: Logprobs | None = None
    finish_reason: str | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "rlens"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
