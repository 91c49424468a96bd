"""What the token ensemble and the RLAE agent cost on top of the models' own compute.

    python -m bench.rlae.cost [--zoo DIR] [--pools ...] [--batch 32 1] [--spans 4 8] [--observe text prompt] [--tokens 32]

Pools: the 4 zoo specialists (zoo prompts), and the two real LLMs SmolLM2-135M + Gemma 3 270M (few-shot prompts).
64 prompts in batches of 32, or 16 prompts one at a time, decoded with an RLAE-PPO agent (untrained: its latency
does not depend on its weights) for exactly --tokens tokens (EOS is masked off); the agent observes the prompt
(embedded once per generation) or the text (prompt + text so far, embedded at every span):
- model compute: the time of every model's forward passes inside the ensemble, i.e. each model decoding the very
  tokens it reads (incremental, with its KV cache): the sum of the single models' own decoding time for those tokens;
- agent: the weights callback (MiniLM embedding, observation, policy);
- merge: everything else (mapping to the union, mixing, picking, re-tokenizing, padding, span statistics);
- overhead = (agent + merge) / model compute; target at span 8: <= 15 %.
Also each model decoding alone (its own greedy tokens, same batch) for reference.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common.machine import machine_facts
from bench.common.args import arguments
from rlens.progress import quiet_transformers
from rlens.rlae.agent import RLAEConfig, make_policy
from rlens.rlae.decode import TokenEnsemble
from rlens.rlae.observe import SentenceEncoder, obs_dim
from rlens.rlae.train import RLAEAgent
from rlens.settings import settings
from rlens.zoo.build import load_backend, load_zoo
from rlens.zoo.fewshot import FAMILIES as FEWSHOT_FAMILIES, fewshot_split
from rlens.zoo.tasks import FAMILIES, generation_split


class NoEOS(TokenEnsemble):
    """Masks the union EOS so that every row decodes exactly max_tokens tokens (equal work across settings)."""

    def own_probs(self, states):
        probs = super().own_probs(states)
        for p, backend in zip(probs, self.backends):
            p[:, backend.tokenizer.eos_token_id] = 0.0
        return probs


def measure(ensemble: NoEOS, agent: RLAEAgent | None, prompts: list[str], batch: int, span: int, tokens: int) -> dict:
    ensemble.model_seconds = [0.0] * len(ensemble.backends)
    agent_seconds, spans, generated = 0.0, 0, 0
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        if agent is None:
            weights = np.ones(len(ensemble.backends))
        else:
            inner = agent.weights_fn(chunk, greedy=True)

            def weights(view, inner=inner):
                nonlocal agent_seconds, spans
                t = time.perf_counter()
                out = inner(view)
                agent_seconds += time.perf_counter() - t
                spans += 1
                return out

        generated += sum(
            len(o.union_tokens) for o in ensemble.generate_batch(chunk, weights, max_tokens=tokens, span=span)
        )
    total = time.perf_counter() - started
    model = sum(ensemble.model_seconds)
    return {
        "total": total,
        "model": model,
        "agent": agent_seconds,
        "merge": total - model - agent_seconds,
        "spans": spans,
        "tokens": generated,
    }


def own_decoding(backends, prompts: list[str], batch: int, tokens: int) -> float:
    """Seconds for every model to decode its own greedy tokens alone (summed over the models)."""
    seconds = 0.0
    for backend in backends:
        alone = NoEOS([backend])
        started = time.perf_counter()
        for start in range(0, len(prompts), batch):
            alone.generate_batch(prompts[start : start + batch], np.ones(1), max_tokens=tokens, span=tokens)
        seconds += time.perf_counter() - started
    return seconds


POOLS = {
    "4 specialists": ["arith-char", "count-bpe", "order-char", "pattern-bpe"],
    "SmolLM2 + Gemma 3": ["smollm2-135m", "gemma3-270m"],
}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", default=None)
    parser.add_argument("--pools", nargs="+", default=list(POOLS), choices=list(POOLS))
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--spans", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--observe", nargs="+", default=["text", "prompt"], choices=["text", "prompt"])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    quiet_transformers()
    torch.set_num_threads(2)
    zoo = {m.name: m for m in load_zoo(args.zoo or settings().service.zoo_dir)}
    encoder = SentenceEncoder()
    print(f"machine: {machine_facts()}; {torch.get_num_threads()} torch threads")
    print(
        "| pool | batch | span | agent observes | tokens/s | model compute s | agent s | merge s | overhead / model compute | agent ms per span call | own decoding s (sum) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for pool in args.pools:
        names = POOLS[pool]
        tasks = (
            generation_split(list(FAMILIES), 64, seed=5)
            if pool == "4 specialists"
            else fewshot_split(list(FEWSHOT_FAMILIES), 64, seed=5)
        )
        backends = [load_backend(zoo[name]) for name in names]
        ensemble = NoEOS(backends)
        measure(ensemble, None, [t.prompt for t in tasks[:4]], 4, 8, 4)  # warm-up
        for batch in args.batch:
            prompts = [t.prompt for t in tasks[: max(16, 2 * batch)]]  # 16 prompts one at a time, 64 in batches of 32
            own = own_decoding(backends, prompts, batch, args.tokens)
            for span in args.spans:
                for observe in args.observe:
                    cfg = RLAEConfig(span=span, max_tokens=args.tokens, observe=observe)
                    agent = RLAEAgent(
                        make_policy(obs_dim(len(names)), len(names), cfg, seed=0), encoder, cfg, len(names)
                    )
                    r = measure(ensemble, agent, prompts, batch, span, args.tokens)
                    print(
                        f"| {pool} | {batch} | {span} | {observe} | {r['tokens'] / r['total']:.0f} | {r['model']:.2f} | {r['agent']:.2f} | {r['merge']:.2f} | "
                        f"{100 * (r['agent'] + r['merge']) / r['model']:.0f} % | {1000 * r['agent'] / max(r['spans'], 1):.1f} | {own:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
