"""The openai backend against real HTTP servers: `rlens serve-model` processes (scores equal the in-process
backend's to 1e-4; a server killed mid-stream becomes a per-query failure) and small servers that misbehave on
purpose (garbage, wrong shapes, 503 then success, hanging)."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from rlens.backends import BackendError, ChoiceQuery, GenerationRequest, create_backend
from rlens.models.ensemble import PoolCaller
from rlens.focal.engine import FocalEngine
from rlens.models.serve import ServerProcess
from rlens.zoo.build import SMOLLM2_GGUF, load_backend, load_zoo, smollm2_dir
from rlens.zoo.tasks import FAMILIES, make_question

QUESTION = ChoiceQuery(id="q1", prompt="Q: add: 12+7=\nA:", choices=[" 19", " 18", " 29", " 20"])


@pytest.fixture(scope="module")
def zoo_models(quick_zoo):
    return {m.name: m for m in load_zoo(quick_zoo)}


@pytest.fixture(scope="module")
def servers(zoo_models):
    started = {name: ServerProcess(Path(zoo_models[name].path), name) for name in ("arith-char", "count-bpe")}
    yield started
    for server in started.values():
        server.kill()


def questions(n: int, seed: int = 0) -> list[ChoiceQuery]:
    rng = np.random.default_rng(seed)
    return [
        ChoiceQuery(id=str(i), prompt=q.prompt, choices=q.choices)
        for i, q in enumerate(make_question(f, rng) for f in FAMILIES for _ in range(n))
    ]


@pytest.mark.parametrize("name", ["arith-char", "count-bpe"])
def test_served_scores_equal_in_process_scores(servers, zoo_models, name):
    remote = create_backend("openai", base_url=servers[name].url, model=name)
    local = load_backend(zoo_models[name])
    for query in questions(4):
        a, b = remote.score_choices(query), local.score_choices(query)
        assert a.loglikelihoods == pytest.approx(b.loglikelihoods, abs=1e-4)
        assert a.is_greedy == b.is_greedy
    assert remote.list_models() == [name]


@pytest.mark.skipif(os.environ.get("RLENS_SKIP_SMOLLM2") == "1", reason="RLENS_SKIP_SMOLLM2=1")
def test_served_smollm2_equals_in_process():
    server = ServerProcess(smollm2_dir(), "smollm2", SMOLLM2_GGUF)
    try:
        from rlens.backends.hf import TransformersBackend

        remote = create_backend("openai", base_url=server.url, model="smollm2")
        local = TransformersBackend.load(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
        query = ChoiceQuery(
            id="fr",
            prompt="Question: What is the capital of France?\nAnswer:",
            choices=[" Paris", " London", " Berlin, the capital of Germany"],
        )
        for q in [query, *questions(1)]:
            assert remote.score_choices(q).loglikelihoods == pytest.approx(
                local.score_choices(q).loglikelihoods, abs=1e-4
            )
    finally:
        server.kill()


def test_generation_through_the_server(servers, zoo_models):
    remote = create_backend("openai", base_url=servers["arith-char"].url, model="arith-char")
    request = GenerationRequest(id="g", prompt=QUESTION.prompt, n=5, max_tokens=6, temperature=1.0, stop=["\n"], seed=3)
    served = remote.generate(request)
    texts = served.texts
    assert len(texts) == 5 and all("\n" not in t for t in texts)
    # the server's usage comes through: what the model in it counted, the same as in process
    assert served.usage == load_backend(zoo_models["arith-char"]).generate(request).usage
    assert served.usage.prompt_tokens > 0 and 5 <= served.usage.completion_tokens <= 30
    assert remote.score_choices(QUESTION).usage.prompt_tokens > 0
    assert remote.generate(request).texts == texts  # seeded
    greedy = remote.generate(GenerationRequest(id="g", prompt=QUESTION.prompt, max_tokens=4, temperature=0.0)).texts
    assert len(greedy) == 1


def test_server_rejects_bad_requests_with_openai_errors(servers):
    url = servers["arith-char"].url + "/completions"
    cases = [
        ({"model": "arith-char", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "arith-char", "prompt": [], "max_tokens": 1}, 400, "empty list"),
        ({"model": "arith-char", "prompt": "x", "logprobs": 1, "max_tokens": 3}, 400, "one greedy token"),
        ({"model": "arith-char", "prompt": "x", "echo": True, "max_tokens": 5}, 400, "echo"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        (
            {"model": "arith-char", "prompt": "x" * 500, "echo": True, "max_tokens": 0, "logprobs": 1},
            400,
            "model window",
        ),
    ]
    for body, status, words in cases:
        response = httpx.post(url, json=body)
        assert response.status_code == status, body
        assert words in response.json()["error"]["message"]
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400


class Misbehaving(BaseHTTPRequestHandler):
    """Answers /v1/completions according to the server's ``mode``; counts requests."""

    def do_POST(self):  # noqa: N802
        server = self.server
        server.requests += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        mode = server.mode
        if mode == "hang":
            time.sleep(5)
        if mode == "503-then-ok" and server.requests == 1:
            return self._send(503, b"overloaded")
        body = {
            "garbage": b"\x00\x01 this is not json",
            "list": b"[1, 2, 3]",
            "no-choices": json.dumps({"id": "x", "created": 0, "model": "m"}).encode(),
            "short": json.dumps(
                {"id": "x", "created": 0, "model": "m", "choices": [{"index": 0, "text": "a", "logprobs": None}]}
            ).encode(),
            "ragged": json.dumps(
                {
                    "id": "x",
                    "created": 0,
                    "model": "m",
                    "choices": [
                        {
                            "index": i,
                            "text": "a",
                            "logprobs": {
                                "tokens": ["a", "b"],
                                "token_logprobs": [None],
                                "top_logprobs": [None, {}],
                                "text_offset": [0, 1],
                            },
                        }
                        for i in range(4)
                    ],
                }
            ).encode(),
            "400": b'{"error": {"message": "bad"}}',
        }.get(mode)
        if mode == "400":
            return self._send(400, body)
        if mode in ("503-then-ok", "hang"):
            prompt = "Q: add: 12+7=\nA:"
            choices = [
                {
                    "index": i,
                    "text": prompt + c,
                    "logprobs": {
                        "tokens": ["Q: add: 12+7=\nA:", c],
                        "token_logprobs": [None, -float(i + 1)],
                        "top_logprobs": [None, {" 19": -1.0}],
                        "text_offset": [0, len(prompt)],
                    },
                }
                for i, c in enumerate(QUESTION.choices)
            ]
            body = json.dumps({"id": "x", "created": 0, "model": "m", "choices": choices}).encode()
        self._send(200, body)

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def misbehaving():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.requests, server.mode = 0, "garbage"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.mark.parametrize(
    "mode, message",
    [
        ("garbage", "malformed response \\(not JSON\\)"),
        ("list", "not a JSON object"),
        ("no-choices", "malformed completion response: \\('choices',\\)"),
        ("short", "choice indices \\[0\\], expected 0..3"),
        ("ragged", "logprobs arrays have different lengths"),
        ("400", "HTTP 400"),
    ],
)
def test_malformed_responses_are_rejected_clearly_without_retry(misbehaving, mode, message):
    misbehaving.mode = mode
    backend = create_backend("openai", base_url=f"http://127.0.0.1:{misbehaving.server_port}/v1", model="m", retries=3)
    with pytest.raises(BackendError, match=message):
        backend.score_choices(QUESTION)
    assert misbehaving.requests == 1


def test_retry_with_backoff_then_success(misbehaving):
    misbehaving.mode = "503-then-ok"
    backend = create_backend(
        "openai", base_url=f"http://127.0.0.1:{misbehaving.server_port}/v1", model="m", retries=2, backoff_s=0.05
    )
    scores = backend.score_choices(QUESTION)
    assert scores.loglikelihoods == [-1.0, -2.0, -3.0, -4.0] and scores.is_greedy == [True, False, False, False]
    assert misbehaving.requests == 2


def test_a_hung_server_times_out_and_never_hangs_the_caller(misbehaving):
    misbehaving.mode = "hang"
    backend = create_backend(
        "openai",
        base_url=f"http://127.0.0.1:{misbehaving.server_port}/v1",
        model="m",
        timeout_s=0.3,
        retries=1,
        backoff_s=0.05,
    )
    start = time.monotonic()
    with pytest.raises(BackendError, match="failed after 2 attempts; last error: ReadTimeout"):
        backend.score_choices(QUESTION)
    assert time.monotonic() - start < 2.0


def test_killed_server_is_a_per_query_failure_and_the_pool_still_answers(zoo_models):
    server = ServerProcess(Path(zoo_models["order-char"].path), "order-char")
    pool = {
        "order-char@http": create_backend(
            "openai", base_url=server.url, model="order-char", timeout_s=2, retries=1, backoff_s=0.05
        ),
        "arith-char": load_backend(zoo_models["arith-char"]),
        "count-bpe": load_backend(zoo_models["count-bpe"]),
    }
    caller = PoolCaller(pool, deadline_s=10)
    engine = FocalEngine(n_models=3, seed=0)
    everyone = np.ones(3, dtype=bool)
    answered_before_kill = 0
    for i, query in enumerate(questions(2)):
        if i == 4:
            server.kill()  # mid-stream
        answers = caller.ask(query, everyone)
        if i < 4:
            assert answers.answered.all() and not answers.failures
            answered_before_kill += 1
            continue
        assert answers.answered.tolist() == [False, True, True]
        [failure] = answers.failures
        assert (
            failure.model == "order-char@http"
            and "failed after 2 attempts" in failure.reason
            and "ConnectError" in failure.reason
        )
        decision = engine.decide(key="t", n_choices=len(query.choices), greedy=True)[0]
        decision.pool = decision.pool & answers.answered
        if decision.pool.any():
            answer = engine.fuse(decision, answers.probs)
            assert 0 <= answer.answer < len(query.choices) and answer.distribution.sum() == pytest.approx(1)
    assert answered_before_kill == 4
    assert caller.failure_counts["order-char@http"] == len(questions(2)) - 4
    caller.close()


def test_pool_deadline_records_a_slow_model(misbehaving, zoo_models):
    misbehaving.mode = "hang"
    slow = create_backend(
        "openai", base_url=f"http://127.0.0.1:{misbehaving.server_port}/v1", model="m", timeout_s=30, retries=0
    )
    caller = PoolCaller({"slow": slow, "arith-char": load_backend(zoo_models["arith-char"])}, deadline_s=0.5)
    start = time.monotonic()
    answers = caller.ask(QUESTION, np.array([True, True]))
    assert time.monotonic() - start < 2.0
    assert answers.answered.tolist() == [False, True]
    assert answers.failures[0].reason == "no answer within the 0.5 s deadline"
    caller.close()


def test_top_k_ensemble_over_servers_reproduces_each_models_greedy_text(servers, zoo_models):
    """RLAE over servers (UniTE top-k): one-hot weights give each served model's own greedy text, EOS included."""
    from rlens.rlae.decode import TokenEnsemble
    from rlens.rlae.topk import TopKEnsemble

    names = ["arith-char", "count-bpe"]
    remote = TopKEnsemble([create_backend("openai", base_url=servers[n].url, model=n) for n in names], k=5)
    local = [TokenEnsemble([load_backend(zoo_models[n])]) for n in names]
    prompts = ["Q: add: 12+7=\nA:", "Q: count a in: a b a a\nA:", "Q: next: 1 3 5\nA:"]
    for m in range(2):
        served = remote.generate_batch(prompts, np.eye(2)[m], max_tokens=8, span=4)
        alone = local[m].generate_batch(prompts, np.ones(1), max_tokens=8, span=4)
        assert [(s.text, s.finish_reason) for s in served] == [(a.text, a.finish_reason) for a in alone]
    mixed = remote.generate_batch(prompts, lambda view: np.tile([0.5, 0.5], (len(view.texts), 1)), max_tokens=8, span=4)
    assert all(len(o.span_weights) >= 1 and o.text == "".join(remote.pieces[t] for t in o.union_tokens) for o in mixed)
    with pytest.raises(BackendError, match="model window"):  # a server error reaches the caller clearly
        remote.generate("x" * 500, np.array([1.0, 0.0]), max_tokens=2)


def test_rlae_generate_over_a_pool_of_servers(servers, zoo_models, tmp_path):
    from typer.testing import CliRunner

    from rlens.cli import app

    pool = tmp_path / "servers.json"
    pool.write_text(
        json.dumps(
            {
                "models": [
                    {"name": n, "backend": "openai", "options": {"base_url": servers[n].url, "model": n}}
                    for n in ("arith-char", "count-bpe")
                ]
            }
        )
    )
    result = CliRunner().invoke(
        app, ["rlae", "generate", "--pool", str(pool), "--weights", "1,0", "--top-k", "3", "Q: add: 12+7=\\nA:"]
    )
    assert result.exit_code == 0 and "span 0: arith-char 1.00  count-bpe 0.00" in result.output, result.output
    mixed = tmp_path / "mixed.json"
    mixed.write_text(
        json.dumps(
            {
                "models": [
                    {
                        "name": "a",
                        "backend": "openai",
                        "options": {"base_url": servers["arith-char"].url, "model": "arith-char"},
                    },
                    {"name": "b", "backend": "transformers", "options": {"path": zoo_models["count-bpe"].path}},
                ]
            }
        )
    )
    result = CliRunner().invoke(app, ["rlae", "generate", "--pool", str(mixed), "--weights", "uniform", "x"])
    assert result.exit_code == 2 and "all `transformers` models (in process) or all `openai` servers" in result.output
