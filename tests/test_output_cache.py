"""The worker's model-output cache: exact keys, the recorded tier, the Redis tier (a real redis-server) and its TTL,
what is never cached, and a cache that fails without failing the call. The model is a real (tiny, random) GPT-2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from redis import Redis

pytest.importorskip("transformers")
import transformers  # noqa: E402

from rlens.backends.base import ChoiceQuery, GenerationRequest  # noqa: E402
from rlens.backends.hf import TransformersBackend  # noqa: E402
from rlens.backends.replay import ReplayBackend  # noqa: E402
from rlens.ports import free_port  # noqa: E402
from rlens.service.worker.cache import (  # noqa: E402
    CachedBackend,
    OutputCache,
    deterministic,
    question_key,
    recorded_answers,
)
from rlens.settings import settings  # noqa: E402
from rlens.zoo.record import QUESTIONS_FILE, read_questions  # noqa: E402

CHARS = list(" abcdefghijklmnopqrstuvwxyz0123456789.,?:()=+-\n")
QUESTION = ChoiceQuery(id="q1", prompt="Q: add: 2+2=\nA:", choices=[" 4", " 5", " 6"])


class CountingBackend(TransformersBackend):
    """A real GPT-2 (random weights, a character tokenizer) that counts what it was asked."""

    calls = 0

    def score_choices(self, query):
        self.calls += 1
        return super().score_choices(query)

    def generate(self, request):
        self.calls += 1
        return super().generate(request)


@pytest.fixture
def model() -> CountingBackend:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(["<eos>"] + CHARS)}, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(CHARS) + 1, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return CountingBackend(transformers.GPT2LMHeadModel(config), fast)


@pytest.fixture
def redis(redis_server):
    client = Redis.from_url(redis_server.url)
    client.flushdb()
    return client


def counted(cache: OutputCache) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    cache.count = lambda model, result: seen.append((model, result))
    return seen


def test_a_key_is_everything_the_answer_depends_on_and_nothing_else():
    key = question_key("m", QUESTION)
    assert key == question_key("m", QUESTION.model_copy(update={"id": "another id"}))  # the id is no part of it
    others = [
        question_key("n", QUESTION),
        question_key("m", QUESTION.model_copy(update={"prompt": "Q: add: 2+2= \nA:"})),
        question_key("m", QUESTION.model_copy(update={"choices": [" 4", " 6", " 5"]})),
        question_key("m", GenerationRequest(id="q1", prompt=QUESTION.prompt, temperature=0)),
    ]
    assert len({key, *others}) == 5
    greedy = GenerationRequest(id="g", prompt="p", temperature=0, max_tokens=8)
    assert question_key("m", greedy) != question_key("m", greedy.model_copy(update={"max_tokens": 9}))
    assert question_key("m", greedy) != question_key("m", greedy.model_copy(update={"stop": ["\n"]}))
    assert deterministic(QUESTION) and deterministic(greedy)
    assert deterministic(GenerationRequest(id="s", prompt="p", temperature=0.7, seed=3))
    assert not deterministic(GenerationRequest(id="s", prompt="p", temperature=0.7))


def test_the_recorded_tier_answers_a_recorded_question_as_the_recording_does(zoo, model):
    answers = recorded_answers(settings().service.demo_data, ["arith-char", "not-recorded"])
    assert len(answers) == zoo.n_questions  # one model of the two was recorded
    row = 7
    question = read_questions(settings().service.demo_data / QUESTIONS_FILE)[row]
    query = ChoiceQuery(id="any id", prompt=question.prompt, choices=question.choices)
    cache = OutputCache(answers, None, "t", 60)
    seen = counted(cache)
    cached = CachedBackend(model, "arith-char", cache)
    replayed = ReplayBackend(zoo, "arith-char").score_choices(query.model_copy(update={"id": str(row)}))
    assert cached.score_choices(query) == replayed and model.calls == 0
    assert seen == [("arith-char", "recorded")]
    # the same question asked of another model of the pool is that model's to answer
    other = CachedBackend(model, "not-recorded", cache).score_choices(query)
    assert model.calls == 1 and len(other.loglikelihoods) == len(question.choices)
    assert seen[-1] == ("not-recorded", "miss")


def test_redis_keeps_an_answer_for_every_worker_for_its_ttl(model, redis):
    first = CachedBackend(model, "m", OutputCache({}, redis, "t", 300))
    second_cache = OutputCache({}, redis, "t", 300)  # another worker's: the same Redis
    seen = counted(second_cache)
    second = CachedBackend(model, "m", second_cache)
    answer = first.score_choices(QUESTION)
    assert model.calls == 1
    assert second.score_choices(QUESTION) == answer and model.calls == 1 and seen == [("m", "hit")]
    (key,) = redis.keys("t:cache:m:*")
    assert 290 <= redis.ttl(key) <= 300
    # a greedy generation is cached too; a sampled one without a seed never is
    greedy = GenerationRequest(id="g", prompt="Q: add: 1+", temperature=0, max_tokens=4)
    assert first.generate(greedy) == second.generate(greedy.model_copy(update={"id": "h"})) and model.calls == 2
    sampled = GenerationRequest(id="s", prompt="Q: add: 1+", temperature=1.0, max_tokens=4, n=2)
    second.generate(sampled)
    second.generate(sampled)
    assert model.calls == 4 and len(redis.keys("t:cache:m:*")) == 2


def test_an_entry_that_does_not_fit_is_asked_again_and_replaced(model, redis):
    cache = OutputCache({}, redis, "t", 300)
    redis.set(f"t:cache:m:{question_key('m', QUESTION)}", b'{"texts": ["written by something else"]}')
    answer = CachedBackend(model, "m", cache).score_choices(QUESTION)
    assert model.calls == 1 and len(answer.loglikelihoods) == 3
    assert CachedBackend(model, "m", cache).score_choices(QUESTION) == answer and model.calls == 1


def test_a_cache_whose_redis_is_down_costs_the_call_nothing_but_an_error_count(model):
    down = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5, socket_timeout=0.5)
    cache = OutputCache({}, down, "t", 300)
    seen = counted(cache)
    answer = CachedBackend(model, "m", cache).score_choices(QUESTION)
    assert model.calls == 1 and np.isclose(sum(answer.probabilities()), 1.0)
    assert seen == [("m", "error"), ("m", "error")]  # the lookup and the write
