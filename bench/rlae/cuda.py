"""The zoo's models on CPU and on CUDA, side by side on one machine: the ``transformers`` backend's multiple-choice
scoring and RLAE's token-level decoding (each model's next-token distribution merged over the union vocabulary,
the weights set span by span).

    python -m bench.rlae.cuda [--zoo DIR] [--runs cpu cuda cuda-bf16] [--pools specialists smollm2 all]
                              [--tasks 256] [--out out/bench_rlae_cuda]

Runs: ``cpu`` (float32, torch's default threads: every core), ``cuda`` (float32), ``cuda-bf16`` (bfloat16 weights).
Scoring: each model's ``score_choices`` on 64 questions of the zoo's four families (seed 7), one at a time:
milliseconds per question (median) and accuracy.
Decoding, per pool (``specialists``: the four specialists, two tokenizers; ``smollm2``: SmolLM2-135M-Instruct
alone; ``all``: both): greedy, span 4, stop at the newline, at most 16 tokens, SmolLM2 reading two solved examples
per family first (as in ``bench.rlae.zoo``), on the zoo's generation stream (seed 7), under a per-span weight rule
(weights ∝ exp(−entropy) of each model over the last span: the decoder's per-span path that an RLAE agent drives;
the agent's own cost, one MiniLM call per request and an MLP per span, is not in these figures): seconds per answer
at batch 1 (16 tasks) and answers and tokens per second at batch 64 (``--tasks`` tasks); exact match, and the
share of answers identical to the first run's.
Writes results.json and prints a table.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from rlens.backends.base import ChoiceQuery
from rlens.backends.hf import TransformersBackend
from rlens.progress import quiet_transformers
from rlens.rlae.decode import SpanView, TokenEnsemble
from rlens.rlae.train import STOP
from rlens.settings import settings
from rlens.zoo.build import ZooModel, load_zoo
from rlens.zoo.tasks import block_stream, generation_stream, training_example

FAMILIES = ["arithmetic", "counting", "ordering", "pattern"]
SPECIALISTS = ["arith-char", "count-bpe", "order-char", "pattern-bpe"]
POOLS = {"specialists": SPECIALISTS, "smollm2": ["smollm2-135m"], "all": ["smollm2-135m", *SPECIALISTS]}
RUNS = {"cpu": ("cpu", torch.float32), "cuda": ("cuda", torch.float32), "cuda-bf16": ("cuda", torch.bfloat16)}
SPAN, MAX_TOKENS, BATCH = 4, 16, 64


def entropy_rule(view: SpanView) -> np.ndarray:
    """Weights ∝ exp(−mean entropy over the last span): the surer model counts more."""
    w = np.exp(-view.entropy)
    return w / w.sum(1, keepdims=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def score(backend: TransformersBackend, questions) -> dict:
    """Milliseconds per question (median of all; the first, a warm-up, left out) and accuracy."""
    times, hits = [], []
    for n, q in enumerate(questions):
        started = time.perf_counter()
        scores = backend.score_choices(ChoiceQuery(id=str(n), prompt=q.prompt, choices=q.choices))
        sync(backend.device)
        times.append(time.perf_counter() - started)
        hits.append(int(np.argmax(scores.loglikelihoods)) == q.label)
    return {"ms_median": 1000 * float(np.median(times[1:])), "accuracy": float(np.mean(hits))}


def decode_run(ensemble: TokenEnsemble, tasks, batch: int, device: str) -> dict:
    """Texts, seconds, union tokens generated, exact match."""
    ensemble.generate_batch([tasks[0].prompt], entropy_rule, max_tokens=2, span=SPAN, stop=STOP)  # warm-up
    sync(device)
    texts, tokens, started = [], 0, time.perf_counter()
    for start in range(0, len(tasks), batch):
        outputs = ensemble.generate_batch(
            [t.prompt for t in tasks[start : start + batch]], entropy_rule, max_tokens=MAX_TOKENS, span=SPAN, stop=STOP
        )
        texts += [o.text for o in outputs]
        tokens += sum(len(o.union_tokens) for o in outputs)
    sync(device)
    seconds = time.perf_counter() - started
    hits = [t.strip() == task.reference for t, task in zip(texts, tasks)]
    return {"texts": texts, "seconds": seconds, "tokens": tokens, "exact_match": float(np.mean(hits))}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=None)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--pools", nargs="+", default=list(POOLS), choices=list(POOLS))
    parser.add_argument("--tasks", type=int, default=256, help="tasks decoded at batch 64")
    add_out(parser, "out/bench_rlae_cuda")
    args = parser.parse_args()
    quiet_transformers()
    console = Console()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    facts = {"machine": machine_facts(), "gpu": gpu, "torch": torch.__version__, "threads": torch.get_num_threads()}
    console.print(facts)
    runs = [r for r in args.runs if RUNS[r][0] == "cpu" or torch.cuda.is_available()]
    zoo = {m.name: m for m in load_zoo(args.zoo or settings().service.zoo_dir)}
    pools = {p: POOLS[p] for p in args.pools if all(name in zoo for name in POOLS[p])}
    missing = sorted(set(args.pools) - set(pools))
    if missing:
        console.print(f"[yellow]left out (a model is not in the zoo): {', '.join(missing)}[/]")
    rng = np.random.default_rng(99)
    shots = "".join(p + c + "\n" for p, c in (training_example(f, rng) for f in FAMILIES for _ in range(2)))
    questions = block_stream(FAMILIES, 4, 16, seed=7)
    tasks = generation_stream(FAMILIES, -(-args.tasks // 32), 32, seed=7)[: args.tasks]
    results: dict = {"facts": facts, "scoring": {}, "decoding": {}}
    for run in runs:
        device, dtype = RUNS[run]
        started = time.perf_counter()
        backends = {name: load(zoo[name], device, dtype) for name in sorted({n for p in pools.values() for n in p})}
        console.print(f"{run}: {len(backends)} models loaded in {time.perf_counter() - started:.1f} s")
        for name, backend in backends.items():
            results["scoring"].setdefault(name, {})[run] = score(backend, questions)
        for pool, names in pools.items():
            contexts = ["" if zoo[n].trained_on else shots for n in names]
            ensemble = TokenEnsemble([backends[n] for n in names], contexts=contexts)
            one = decode_run(ensemble, tasks[:16], 1, device)
            many = decode_run(ensemble, tasks, BATCH, device)
            first = results["decoding"].get(pool, {}).get(runs[0])
            results["decoding"].setdefault(pool, {})[run] = {
                "s_per_answer_batch1": one["seconds"] / 16,
                "answers_per_s_batch64": len(tasks) / many["seconds"],
                "tokens_per_s_batch64": many["tokens"] / many["seconds"],
                "exact_match": many["exact_match"],
                "same_as_first_run": float(np.mean([a == b for a, b in zip(many["texts"], first["texts"])]))
                if first
                else 1.0,
                "texts": many["texts"],
            }
            console.print(f"{run} {pool}: {results['decoding'][pool][run]['answers_per_s_batch64']:.1f} answers/s")
        del backends
        if device == "cuda":
            torch.cuda.empty_cache()
    table = Table(title=f"RLAE decoding and scoring, {gpu}; CPU {facts['machine']} ({facts['threads']} threads)")
    for column in ("what", *runs):
        table.add_column(column, justify="right")
    for name, by_run in results["scoring"].items():
        table.add_row(
            f"score {name}: ms/question (acc.)",
            *(f"{by_run[r]['ms_median']:.1f} ({by_run[r]['accuracy']:.2f})" for r in runs),
        )
    for pool, by_run in results["decoding"].items():
        table.add_row(f"decode {pool}: s/answer at batch 1", *(f"{by_run[r]['s_per_answer_batch1']:.3f}" for r in runs))
        table.add_row(
            f"decode {pool}: answers/s (tokens/s) at batch 64",
            *(f"{by_run[r]['answers_per_s_batch64']:.1f} ({by_run[r]['tokens_per_s_batch64']:.0f})" for r in runs),
        )
        table.add_row(
            f"decode {pool}: exact match (same as {runs[0]})",
            *(f"{by_run[r]['exact_match']:.3f} ({by_run[r]['same_as_first_run']:.3f})" for r in runs),
        )
    console.print(table)
    write_json(args.out / "results.json", results)


def load(model: ZooModel, device: str, dtype: torch.dtype) -> TransformersBackend:
    return TransformersBackend.load(model.path, gguf_file=model.gguf_file, device=device, dtype=dtype)


if __name__ == "__main__":
    main()
