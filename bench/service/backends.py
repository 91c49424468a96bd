"""Backend throughput: choice scoring in-process vs through `rlens serve-model` (HTTP), and model calls saved
by the Decider.

    python -m bench.service.backends [--questions N] [--concurrency C] [--out bench/out/backends.json]

1. SmolLM2-135M (GGUF, CPU) scores the first N questions of the bundled stream (4 choices each): in-process
   (`transformers` backend, prefix-shared batch) and through a `rlens serve-model` process with the `openai`
   backend, one request at a time and with C requests in flight. Prints questions/s and the overhead ratio.
2. The ensemble's model calls per query on the bundled stream: RL-Focal (Decider prunes) against RL-Focal with
   every model (no Decider), both protocols, from the replay harness.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.common.machine import machine_facts
from bench.common.args import add_out, arguments, write_json
from rlens.backends import ChoiceQuery, create_backend
from rlens.backends.hf import TransformersBackend
from rlens.records.dataset import load_dataset
from rlens.focal.config import FocalConfig
from rlens.evaluation.protocols import Protocol
from rlens.evaluation.replay import replay
from rlens.models.serve import ServerProcess
from rlens.settings import settings
from rlens.zoo.build import SMOLLM2_GGUF, smollm2_dir
from rlens.zoo.record import QUESTIONS_FILE, read_questions


def rate(score, queries: list[ChoiceQuery], concurrency: int = 1) -> float:
    """Questions per second over ``queries`` (after one warm-up question)."""
    score(queries[0])
    start = time.perf_counter()
    if concurrency == 1:
        for query in queries:
            score(query)
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(score, queries))
    return len(queries) / (time.perf_counter() - start)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    add_out(parser, "bench/out/backends.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    data = settings().service.demo_data
    queries = [
        ChoiceQuery(id=str(i), prompt=q.prompt, choices=q.choices)
        for i, q in enumerate(read_questions(data / QUESTIONS_FILE)[: args.questions])
    ]

    local = TransformersBackend.load(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    results = {"questions": len(queries), "torch_threads": torch.get_num_threads()}
    results["in_process_qps"] = rate(local.score_choices, queries)
    del local
    server = ServerProcess(smollm2_dir(), "smollm2", SMOLLM2_GGUF)
    try:
        remote = create_backend("openai", base_url=server.url, model="smollm2")
        results["http_qps"] = rate(remote.score_choices, queries)
        results[f"http_qps_concurrency_{args.concurrency}"] = rate(remote.score_choices, queries, args.concurrency)
    finally:
        server.kill()
    results["http_overhead_ratio"] = results["in_process_qps"] / results["http_qps"]
    print(f"SmolLM2 choice scoring, {len(queries)} questions x 4 choices:")
    print(
        f"  in-process {results['in_process_qps']:.1f} q/s; HTTP {results['http_qps']:.1f} q/s "
        f"({args.concurrency} in flight: {results[f'http_qps_concurrency_{args.concurrency}']:.1f} q/s); "
        f"in-process / HTTP = {results['http_overhead_ratio']:.2f}"
    )

    dataset = load_dataset(data)
    for protocol in (Protocol.paper, Protocol.stream):
        run = replay(dataset, protocol, 0, FocalConfig(), ["rl_focal", "rl_focal_all_models"], workers=2)
        methods = run.results.methods
        calls = {name: methods[name].mean_models_called for name in ("rl_focal", "rl_focal_all_models")}
        results[f"calls_{protocol.value}"] = {**calls, "accuracy": {name: methods[name].accuracy for name in calls}}
        print(
            f"  {protocol.value}: calls per query {calls['rl_focal']:.2f} with the Decider vs {calls['rl_focal_all_models']:.2f} without "
            f"(accuracy {100 * methods['rl_focal'].accuracy:.1f} vs {100 * methods['rl_focal_all_models'].accuracy:.1f} %)"
        )
    write_json(
        args.out,
        results,
    )


if __name__ == "__main__":
    main()
