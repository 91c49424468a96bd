"""An instant OpenAI-compatible model server for gateway comparisons: every chat completion gets the same short
answer at once, so what a gateway in front of it adds is all that a client measures.

    python -m bench.common.upstream --port 8011

Answers ``POST /v1/chat/completions`` and ``/chat/completions`` (with ``usage``) and ``GET /v1/models``.
"""

from __future__ import annotations

import time

from aiohttp import web

from bench.common.args import arguments


def completion(model: str) -> dict:
    return {
        "id": "chatcmpl-upstream",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "B"}, "finish_reason": "stop", "logprobs": None}
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }


async def chat(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response(completion(str(body.get("model", "upstream"))))


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "upstream", "object": "model", "owned_by": "bench"}]})


def app() -> web.Application:
    application = web.Application()
    application.add_routes(
        [
            web.post("/v1/chat/completions", chat),
            web.post("/chat/completions", chat),
            web.get("/v1/models", models),
        ]
    )
    return application


if __name__ == "__main__":
    parser = arguments(__doc__)
    parser.add_argument("--port", type=int, required=True)
    web.run_app(app(), host="127.0.0.1", port=parser.parse_args().port, access_log=None, print=None)
