"""A ranker-based ensemble, the baseline RLAE is compared with (in the spirit of LLM-Blender's PairRanker):
every model answers in full, a learned scorer rates each (question, answer) pair and the best-rated answer wins.

The scorer is pointwise: a logistic regression on the frozen MiniLM embedding of the question (the prompt's last
line) followed by the answer, plus which model answered, trained on a training split to predict exact match.
It costs every model's whole generation plus one MiniLM call per candidate, where RLAE decodes once.
"""

from __future__ import annotations

import numpy as np
import torch

from rlens.rlae.observe import EMBED_DIM, SentenceEncoder
from rlens.zoo.tasks import GenerationTask, exact_match


def pair_texts(tasks: list[GenerationTask], answers: list[str]) -> list[str]:
    return [f"{task.prompt.splitlines()[-1]} {answer.strip()}" for task, answer in zip(tasks, answers)]


class AnswerRanker:
    """Scores (task, model, answer); :meth:`choose` picks each task's best-scored model."""

    def __init__(self, encoder: SentenceEncoder, n_models: int, l2: float = 1e-3, epochs: int = 300, seed: int = 0):
        self.encoder, self.n_models, self.l2, self.epochs, self.seed = encoder, n_models, l2, epochs, seed
        self.linear = torch.nn.Linear(EMBED_DIM + n_models, 1)

    def features(self, tasks: list[GenerationTask], outputs: list[list[str]]) -> torch.Tensor:
        """[N, M, 384 + M]: each model's answer embedded with its question, and the model's one-hot."""
        embedded = np.stack([self.encoder.encode(pair_texts(tasks, answers)) for answers in outputs], 1)
        models = np.broadcast_to(np.eye(self.n_models, dtype=np.float32), (len(tasks), self.n_models, self.n_models))
        return torch.from_numpy(np.concatenate([embedded, models], 2).astype(np.float32))

    def fit(self, tasks: list[GenerationTask], outputs: list[list[str]]) -> "AnswerRanker":
        """Train on each model's answers [M][N] to ``tasks`` (full-batch Adam on the logistic loss)."""
        x = self.features(tasks, outputs).reshape(-1, EMBED_DIM + self.n_models)
        y = torch.tensor(
            [
                [float(exact_match(outputs[m][n], task.reference)) for m in range(self.n_models)]
                for n, task in enumerate(tasks)
            ]
        ).reshape(-1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.linear.reset_parameters()
        optimizer = torch.optim.Adam(self.linear.parameters(), lr=0.05, weight_decay=self.l2)
        for _ in range(self.epochs):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self.linear(x).squeeze(-1), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return self

    @torch.no_grad()
    def choose(self, tasks: list[GenerationTask], outputs: list[list[str]]) -> np.ndarray:
        """The index of the chosen model per task (ties: the first model)."""
        return self.linear(self.features(tasks, outputs)).squeeze(-1).argmax(1).numpy()
