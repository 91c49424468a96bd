"""The same real-LLM pool served by model servers (the ``openai`` top-k path) against in process.

    python -m bench.rlae.serve [--zoo DIR] [--run out/bench_rlae_llm/runs/ppo-0] [--k 5 20] [--out out/bench_rlae_serve]

SmolLM2-135M and Gemma 3 270M each behind ``rlens serve-model`` (a child process on this machine, no prefix
cache: every step re-reads prompt + text), decoded by :class:`rlens.rlae.topk.TopKEnsemble` over the top k tokens
of each, against the in-process :class:`rlens.rlae.decode.TokenEnsemble` (full distributions, KV caches). Tasks: the
seen-family test stream of ``bench_rlae_llm.py`` (168 few-shot tasks, at most 20 tokens, batches of 32).
Weights: uniform (GaC), and a trained RLAE agent when ``--run`` names one. Writes results.json and a table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.rlae.llm import POOL, SEEN
from bench.common.machine import machine_facts
from bench.common.args import add_out, arguments
from rlens.backends import create_backend
from rlens.progress import quiet_transformers
from rlens.rlae.agent import RLAEConfig
from rlens.rlae.decode import TokenEnsemble
from rlens.evaluation.rlae import correct
from rlens.rlae.observe import SentenceEncoder
from rlens.rlae.topk import TopKEnsemble
from rlens.rlae.train import STOP, RLAEAgent, load_agent
from rlens.models.serve import ServerProcess
from rlens.settings import settings
from rlens.zoo.build import load_backend, load_zoo
from rlens.zoo.fewshot import fewshot_stream


def timed(ensemble, tasks, source, cfg) -> tuple[float, float, int]:
    """(exact match, seconds per answer, generated tokens) of one greedy pass in batches of 32."""
    started, texts, tokens = time.perf_counter(), [], 0
    for start in range(0, len(tasks), 32):
        prompts = [t.prompt for t in tasks[start : start + 32]]
        weights = source.weights_fn(prompts, greedy=True) if isinstance(source, RLAEAgent) else source
        outputs = ensemble.generate_batch(prompts, weights, max_tokens=cfg.max_tokens, span=cfg.span, stop=STOP)
        texts += [o.text for o in outputs]
        tokens += sum(len(o.union_tokens) for o in outputs)
    return float(correct(texts, tasks).mean()), (time.perf_counter() - started) / len(tasks), tokens


def agent_cfg(source, cfg: RLAEConfig) -> RLAEConfig:
    return source.cfg if isinstance(source, RLAEAgent) else cfg


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=None)
    parser.add_argument("--run", type=Path, default=None, help="a trained RLAE run over the same two models")
    parser.add_argument("--k", type=int, nargs="+", default=[5, 20])
    add_out(parser, "out/bench_rlae_serve")
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_transformers()
    print(f"machine: {machine_facts()}; 2 torch threads in process, each server its own process", flush=True)
    zoo = {m.name: m for m in load_zoo(args.zoo or settings().service.zoo_dir)}
    tasks = fewshot_stream(SEEN, 24, seed=7)
    cfg = RLAEConfig(max_tokens=20)
    sources: dict[str, object] = {"uniform (GaC)": np.ones(len(POOL))}
    if args.run is not None:
        agent, models, _ = load_agent(args.run, SentenceEncoder())
        if models != POOL:
            raise SystemExit(f"{args.run} was trained on {models}, not {POOL}")
        sources[f"RLAE ({agent.cfg.variant}, {args.run.name})"] = agent
    rows = []
    local = TokenEnsemble([load_backend(zoo[name]) for name in POOL])
    for name, source in sources.items():
        accuracy, seconds, tokens = timed(local, tasks, source, agent_cfg(source, cfg))
        rows.append(
            {
                "weights": name,
                "where": "in process",
                "k": None,
                "exact_match": accuracy,
                "s_per_answer": seconds,
                "ms_per_token": 1000 * seconds * len(tasks) / tokens,
            }
        )
        print(rows[-1], flush=True)
    del local
    servers = [ServerProcess(Path(zoo[name].path), name, zoo[name].gguf_file) for name in POOL]
    try:
        backends = [
            create_backend("openai", base_url=server.url, model=name, timeout_s=600)
            for server, name in zip(servers, POOL)
        ]
        for k in args.k:
            remote = TopKEnsemble(backends, k=k)
            for name, source in sources.items():
                accuracy, seconds, tokens = timed(remote, tasks, source, agent_cfg(source, cfg))
                rows.append(
                    {
                        "weights": name,
                        "where": "2 x rlens serve-model",
                        "k": k,
                        "exact_match": accuracy,
                        "s_per_answer": seconds,
                        "ms_per_token": 1000 * seconds * len(tasks) / tokens,
                    }
                )
                print(rows[-1], flush=True)
    finally:
        for server in servers:
            server.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"machine": machine_facts(), "tasks": len(tasks), "rows": rows}, indent=1)
    )
    print(
        "| weights | models | top k | exact match | s per answer | ms per generated token (batches of 32) |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['weights']} | {r['where']} | {r['k'] or 'full'} | {100 * r['exact_match']:.1f} % | {r['s_per_answer']:.2f} | {r['ms_per_token']:.0f} |"
        )


if __name__ == "__main__":
    main()
