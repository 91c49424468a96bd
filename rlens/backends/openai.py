"""The ``openai`` backend: any OpenAI-compatible completions server (vLLM, SGLang, llama.cpp, ``rlens serve-model``).

Choice scoring sends one batched request per query: every ``prompt + choice`` with ``echo``, ``logprobs=1`` and
``max_tokens=1`` (as lm-evaluation-harness's ``local-completions`` does). A choice's log-likelihood is the sum over
the echoed tokens that hold part of the continuation, found by ``text_offset``. The context's trailing spaces move
to the continuation, as in lm-eval. Where the server's tokenizer splits the prompt at the context boundary (the
usual case: choices start with a space), this equals the in-process ``transformers`` backend's score.

Robustness: one pooled HTTP client (keep-alive), at most ``max_concurrency`` requests in flight, a timeout per
attempt, and retries with exponential backoff on transport errors, timeouts, 408, 429 and 5xx. Any other failure
(4xx, malformed JSON, a response that breaks the schema or does not fit the request) is a :class:`BackendError`
at once, naming the server and the problem; so a query's worst case is bounded by
``(retries + 1) * timeout_s + backoff``, and a dead or hung server never hangs the caller.
"""

from __future__ import annotations

import threading
import time
from typing import Annotated

import httpx
from pydantic import Field, ValidationError, validate_call

from rlens.backends.base import (
    Backend,
    BackendError,
    ChoiceQuery,
    ChoiceScores,
    GenerationRequest,
    Generations,
    register_backend,
)
from rlens.backends.openai_protocol import CompletionChoice, CompletionRequest, CompletionResponse, ModelList, Usage

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class _Retryable(Exception):
    pass


@register_backend("openai")
class OpenAIBackend(Backend):
    @validate_call
    def __init__(
        self,
        base_url: Annotated[str, Field(pattern=r"^https?://\S+$")],
        model: Annotated[str, Field(min_length=1)],
        api_key: str | None = None,
        timeout_s: Annotated[float, Field(gt=0)] = 30.0,
        retries: Annotated[int, Field(ge=0)] = 2,
        backoff_s: Annotated[float, Field(ge=0)] = 0.25,
        max_concurrency: Annotated[int, Field(ge=1)] = 8,
    ):
        """``base_url`` ends in ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``); ``model`` is the served model's name. The
        options are checked as the pool file's are (:func:`rlens.models.pool.option_errors`)."""
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        self.backoff_s = backoff_s
        self.slots = threading.BoundedSemaphore(max_concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )

    def close(self) -> None:
        self.client.close()

    def _where(self) -> str:
        return f"openai backend {self.model!r} at {self.base_url}"

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        """One call with retries; the parsed JSON object, or a :class:`BackendError`."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with self.slots:
                    response = self.client.request(method, path, json=payload)
                if response.status_code in RETRY_STATUS:
                    raise _Retryable(f"HTTP {response.status_code}")
            except (httpx.TimeoutException, httpx.TransportError, _Retryable) as exc:
                last = f"{exc.__class__.__name__}: {exc}" if not isinstance(exc, _Retryable) else str(exc)
                continue
            if response.status_code >= 400:
                raise BackendError(f"{self._where()}: HTTP {response.status_code}: {response.text[:300]}")
            try:
                body = response.json()
            except ValueError:
                raise BackendError(f"{self._where()}: malformed response (not JSON): {response.text[:200]!r}") from None
            if not isinstance(body, dict):
                raise BackendError(f"{self._where()}: malformed response (not a JSON object): {response.text[:200]!r}")
            return body
        raise BackendError(f"{self._where()}: failed after {self.retries + 1} attempts; last error: {last}")

    def _complete(self, request: CompletionRequest) -> tuple[list[CompletionChoice], Usage | None]:
        """The response's choices in prompt order (``n`` per prompt), checked against the request, and the tokens
        the server says it used."""
        body = self._request("POST", "/completions", request.model_dump(exclude_none=True))
        try:
            response = CompletionResponse.model_validate(body)
        except ValidationError as exc:
            raise BackendError(
                f"{self._where()}: malformed completion response: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
            ) from None
        expected = len(request.prompts) * request.n
        choices = sorted(response.choices, key=lambda c: c.index)
        if [c.index for c in choices] != list(range(expected)):
            raise BackendError(
                f"{self._where()}: malformed completion response: choice indices {[c.index for c in choices]}, expected 0..{expected - 1}"
            )
        return choices, response.usage

    def list_models(self) -> list[str]:
        try:
            return [card.id for card in ModelList.model_validate(self._request("GET", "/models")).data]
        except ValidationError as exc:
            raise BackendError(f"{self._where()}: malformed /models response: {exc.errors()[0]['msg']}") from None

    def score_choices(self, query: ChoiceQuery) -> ChoiceScores:
        boundary = len(query.prompt.rstrip(" "))  # lm-eval: the context's trailing spaces belong to the continuation
        if boundary == 0:
            raise BackendError(
                f"query {query.id}: the openai backend needs a non-empty prompt (the first token has no log-probability)"
            )
        prompts = [query.prompt + choice for choice in query.choices]
        request = CompletionRequest(
            model=self.model, prompt=prompts, max_tokens=1, temperature=0.0, echo=True, logprobs=1
        )
        loglikelihoods, greedy = [], []
        choices, usage = self._complete(request)
        for text, choice in zip(prompts, choices):
            total, is_greedy = self._continuation_score(query.id, text, boundary, choice)
            loglikelihoods.append(total)
            greedy.append(is_greedy)
        return ChoiceScores(loglikelihoods=loglikelihoods, is_greedy=greedy, usage=usage)

    def _continuation_score(
        self, query_id: str, text: str, boundary: int, choice: CompletionChoice
    ) -> tuple[float, bool]:
        lp = choice.logprobs
        if lp is None or lp.top_logprobs is None:
            raise BackendError(
                f"{self._where()}: malformed completion response: no logprobs with top tokens for an echo request"
            )
        offsets = lp.text_offset
        in_prompt = [i for i, offset in enumerate(offsets) if offset < len(text)]
        total, is_greedy, used = 0.0, True, 0
        for i in in_prompt:
            end = offsets[i + 1] if i + 1 < len(offsets) else len(text)
            if max(end, offsets[i] + len(lp.tokens[i])) <= boundary:
                continue  # a context token
            logprob, top = lp.token_logprobs[i], lp.top_logprobs[i]
            if logprob is None or not top:
                raise BackendError(
                    f"{self._where()}: malformed completion response: query {query_id}: continuation token {i} has no log-probability"
                )
            total += logprob
            is_greedy = is_greedy and max(top, key=top.__getitem__) == lp.tokens[i]
            used += 1
        if used == 0:
            raise BackendError(f"query {query_id}: a choice encodes to no tokens")
        return total, is_greedy

    def next_token_tops(self, prompts: list[str], k: int) -> list[dict[str, float]]:
        """For each prompt, the server's top ``k`` next tokens (text -> log-probability), from one batched request."""
        request = CompletionRequest(model=self.model, prompt=prompts, max_tokens=1, temperature=0.0, logprobs=k)
        tops = []
        for choice in self._complete(request)[0]:
            lp = choice.logprobs
            if lp is None or not lp.top_logprobs or not lp.top_logprobs[0]:
                raise BackendError(
                    f"{self._where()}: malformed completion response: no top logprobs for the next token (the server must return logprobs={k})"
                )
            tops.append(lp.top_logprobs[0])
        return tops

    def generate(self, request: GenerationRequest) -> Generations:
        completion = CompletionRequest(
            model=self.model,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            n=request.n,
            stop=request.stop or None,
            seed=request.seed,
        )
        choices, usage = self._complete(completion)
        return Generations(texts=[choice.text for choice in choices], usage=usage)
