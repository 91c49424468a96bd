"""LiteLLM in front of rlens (the recipe of docs/litellm.md): a real LiteLLM proxy (from PyPI, in a venv of its own:
its pins are not rlens's; ``.ci/run`` installs it in ``.litellm-venv``) routes a model name to rlens's gateway as an
OpenAI-compatible upstream, passes rlens's extension object through, hands the client rlens's ``usage``, and prices
it in its own spend tracking (``x-litellm-response-cost``) at the prices its config gives."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from brokers import replay_stack_for_tests
from rlens.local.servers import LocalProcess
from rlens.ports import free_port

LITELLM = os.environ.get("RLENS_TEST_LITELLM") or shutil.which("litellm")
pytestmark = pytest.mark.skipif(
    LITELLM is None,
    reason="LiteLLM's proxy is not installed: RLENS_TEST_LITELLM=<venv>/bin/litellm after "
    "`pip install 'litellm[proxy]==1.108.7'` in a venv of its own (.ci/run does)",
)
MASTER_KEY = "sk-litellm-test"
PRICE_IN, PRICE_OUT = 2e-6, 5e-6  # money per token, LiteLLM's config
CHOICES = ["A", "B", "C", "D"]


def litellm_config(gateway_url: str, rlens_key: str) -> str:
    """What a team adds to its LiteLLM config: one model name routed to rlens (docs/litellm.md)."""
    return (
        "model_list:\n"
        "  - model_name: ensemble\n"
        "    litellm_params:\n"
        "      model: openai/rlens-focal\n"
        f"      api_base: {gateway_url}/v1\n"
        f"      api_key: {rlens_key}\n"
        f"      input_cost_per_token: {PRICE_IN}\n"
        f"      output_cost_per_token: {PRICE_OUT}\n"
        "      extra_headers: {X-Rlens-Stream: via-litellm}\n"
        f"general_settings: {{master_key: {MASTER_KEY}}}\n"
    )


def test_litellm_routes_a_model_to_rlens_and_charges_what_rlens_used(tmp_path: Path):
    stack = replay_stack_for_tests(tmp_path)
    proxy = None
    try:
        stack.start_service(workers=1, gateway=True, wait_s=120)
        gateway = next(u for name, u in stack.http_urls().items() if name.startswith("gateway:"))
        rlens_key = stack.gateway_key.read_text().strip()
        (tmp_path / "litellm.yaml").write_text(litellm_config(gateway, rlens_key))
        port = free_port()
        proxy = LocalProcess(
            [str(LITELLM), "--config", str(tmp_path / "litellm.yaml"), "--port", str(port), "--num_workers", "1"],
            port,
            "LiteLLM",
            300.0,
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},  # offline: no cost map download
        )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=MASTER_KEY, max_retries=2, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model="ensemble",
            messages=[{"role": "user", "content": "question 7"}],
            extra_body={"rlens": {"choices": CHOICES, "reference_id": "7"}},
        )
        reply = raw.parse()
        assert reply.choices[0].message.content in CHOICES, reply
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens > 0, reply
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        # LiteLLM's own spend tracking prices rlens's usage
        cost = float(raw.headers["x-litellm-response-cost"])
        assert cost == pytest.approx(usage.prompt_tokens * PRICE_IN + usage.completion_tokens * PRICE_OUT, rel=1e-6)
        # and the usage is rlens's: the same answer, read from rlens's gateway by its id
        answered = httpx.get(
            f"{gateway}/v1/answers/{reply.id}", headers={"Authorization": f"Bearer {rlens_key}"}, timeout=30
        )
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["prompt_tokens"] == usage.prompt_tokens
        assert answered.json()["rlens"]["stream"] == "via-litellm"  # the stream LiteLLM's config names
    finally:
        if proxy is not None:
            proxy.stop()
        stack.stop()
