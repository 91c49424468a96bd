"""``rlens serve-model``: a small OpenAI-compatible completions server over the ``transformers`` backend.

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (text prompts, batched; ``echo`` + ``logprobs`` for the
prompt tokens' log-probabilities; ``max_tokens`` 1 + ``logprobs`` k at temperature 0 for the greedy next token and
its top k; ``n`` samples; ``stop``; ``seed``) and ``GET /health``. It lets the ``openai`` backend be tested against a
real server here, and lets users without GPUs run the whole stack. Requests that the server cannot honour
(token-id prompts, ``logprobs`` on several or sampled tokens without ``echo``) get an OpenAI-style 400.
One model call runs at a time (a lock), in FastAPI's thread pool. :class:`ServerProcess` runs the server as a
child process (tests, benchmarks, the local stack).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlens.backends.base import BackendError, GenerationRequest
from rlens.backends.hf import NextToken, PromptLogprobs, TransformersBackend
from rlens.ports import free_port
from rlens.backends.openai_protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Logprobs,
    ModelCard,
    ModelList,
    Usage,
)


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def echo_choice(
    index: int, prompt: str, scored: PromptLogprobs, max_tokens: int, want_logprobs: bool
) -> CompletionChoice:
    """The prompt echoed back, plus the greedy next token when ``max_tokens`` is 1."""
    tokens, offsets, logprobs, top = list(scored.tokens), list(scored.offsets), list(scored.logprobs), list(scored.top)
    text = prompt
    if max_tokens:
        tokens.append(scored.next_token)
        offsets.append(len(prompt))
        logprobs.append(scored.next_logprob)
        top.append(scored.next_top)
        text += scored.next_token
    logprob_block = (
        Logprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets)
        if want_logprobs
        else None
    )
    return CompletionChoice(index=index, text=text, logprobs=logprob_block, finish_reason="length")


def next_token_choice(index: int, prompt: str, next_token: NextToken, eos_text: str) -> CompletionChoice:
    """The greedy next token and its top tokens; the EOS ends the text ("" and finish reason "stop"), as vLLM does."""
    ended = next_token.token == eos_text
    text = "" if ended else next_token.token
    logprobs = Logprobs(
        tokens=[next_token.token],
        token_logprobs=[next_token.logprob],
        top_logprobs=[next_token.top],
        text_offset=[len(prompt)],
    )
    return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason="stop" if ended else "length")


def create_app(backend: TransformersBackend, model_name: str) -> FastAPI:
    app = FastAPI(title="rlens serve-model", description=f"OpenAI-compatible completions for {model_name}")
    lock = threading.Lock()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        return error(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name)])

    @app.post("/v1/completions", response_model=None)
    def completions(request: CompletionRequest) -> CompletionResponse | JSONResponse:
        if request.model != model_name:
            return error(
                404, f"the model {request.model!r} does not exist; this server serves {model_name!r}", "not_found_error"
            )
        top_k_only = request.logprobs is not None and not request.echo
        if top_k_only and (request.max_tokens != 1 or request.n > 1 or request.temperature > 0):
            return error(
                400,
                "rlens serve-model returns logprobs with echo (prompt scoring) or for one greedy token (max_tokens 1, n 1, temperature 0)",
            )
        if request.echo and (request.max_tokens > 1 or request.n > 1 or request.temperature > 0 and request.max_tokens):
            return error(400, "echo is supported for prompt scoring: max_tokens 0 or 1, n 1, temperature 0")
        choices, prompt_tokens, completion_tokens = [], 0, 0
        try:
            with lock:
                if top_k_only:
                    eos_text = backend.tokenizer.decode([backend.tokenizer.eos_token_id])
                    for i, (prompt, next_token) in enumerate(
                        zip(request.prompts, backend.next_tokens(request.prompts, max(request.logprobs or 1, 1)))
                    ):
                        choices.append(next_token_choice(i, prompt, next_token, eos_text))
                        prompt_tokens += next_token.prompt_tokens
                        completion_tokens += 1
                elif request.echo:
                    for i, (prompt, scored) in enumerate(
                        zip(request.prompts, backend.prompt_logprobs(request.prompts, max(request.logprobs or 1, 1)))
                    ):
                        choices.append(echo_choice(i, prompt, scored, request.max_tokens, request.logprobs is not None))
                        prompt_tokens += len(scored.tokens)
                        completion_tokens += request.max_tokens
                else:
                    for p, prompt in enumerate(request.prompts):
                        generation = GenerationRequest(
                            id=str(p),
                            prompt=prompt,
                            n=request.n,
                            max_tokens=request.max_tokens,
                            temperature=request.temperature,
                            stop=request.stops,
                            seed=request.seed,
                        )
                        samples, used = backend.sample(generation)
                        for k, (text, reason) in enumerate(samples):
                            choices.append(CompletionChoice(index=p * request.n + k, text=text, finish_reason=reason))
                        prompt_tokens += used.prompt_tokens
                        completion_tokens += used.completion_tokens
        except BackendError as exc:
            return error(400, str(exc))
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name, choices=choices, usage=usage
        )

    return app


class ServerProcess:
    """``rlens serve-model`` in a child process on a free local port; ready once ``/health`` answers (a busy machine may
    take minutes to load a model: the wait is generous, and a server that exits ends it at once)."""

    def __init__(self, path: Path, name: str, gguf_file: str | None = None, startup_s: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = [
            sys.executable,
            "-m",
            "rlens.cli",
            "serve-model",
            str(path),
            "--port",
            str(self.port),
            "--name",
            name,
        ]
        if gguf_file:
            command += ["--gguf-file", gguf_file]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"serve-model exited with {self.process.returncode}: {self.process.communicate()[0].decode()[-2000:]}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"serve-model {path} did not answer /health within {startup_s:g} s")

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed one would."""
        self.process.kill()
        self.process.wait()
