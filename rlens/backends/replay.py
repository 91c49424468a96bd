"""The ``replay`` backend: one model's recorded outputs from a dataset directory (benchmarks, back-tests).

Query ids are question indices of the dataset. Recorded probabilities are returned as log-probabilities:
the softmax of the original log-likelihoods, so they differ from them by a constant per question.
"""

from __future__ import annotations

import numpy as np

from rlens.backends.base import Backend, BackendError, ChoiceQuery, ChoiceScores, register_backend
from rlens.dataset import RecordedDataset


@register_backend("replay")
class ReplayBackend(Backend):
    blocking = False
    def __init__(self, dataset: RecordedDataset, model: int | str):
        self.dataset = dataset
        self.model = dataset.model_names.index(model) if isinstance(model, str) else int(model)
        if not 0 <= self.model < dataset.n_models:
            raise ValueError(f"model index {self.model} is outside the dataset's {dataset.n_models} models")

    def score_choices(self, query: ChoiceQuery) -> ChoiceScores:
        try:
            row = int(query.id)
        except ValueError:
            raise BackendError(f"replay backend: query id {query.id!r} is not a question index") from None
        if not 0 <= row < self.dataset.n_questions:
            raise BackendError(f"replay backend: no recorded question {row} (dataset has {self.dataset.n_questions})")
        valid = np.flatnonzero(self.dataset.choice_mask[row])
        if len(valid) != len(query.choices):
            raise BackendError(f"replay backend: question {row} has {len(valid)} recorded choices, the query {len(query.choices)}")
        probs = self.dataset.probs[row, self.model, valid].astype(np.float64)
        best = probs.argmax()
        # built from the dataset's own arrays, already of the right types: no validation needed on this hot path
        return ChoiceScores.model_construct(loglikelihoods=np.log(np.maximum(probs, 1e-30)).tolist(), is_greedy=[bool(i == best) for i in range(len(valid))])
