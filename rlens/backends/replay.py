"""The ``replay`` backend: one model's recorded outputs from a dataset directory (benchmarks, back-tests).

Query ids are question indices of the dataset. Recorded probabilities are returned as log-probabilities:
the softmax of the original log-likelihoods, so they differ from them by a constant per question. Each question's
answer is built once and then shared (callers only read it). An open-ended dataset (recorded samples,
:mod:`rlens.records.open_ended`) also answers ``generate``: the model's first ``n`` recorded texts of the question.
"""

from __future__ import annotations

import numpy as np

from rlens.backends.base import (
    Backend,
    BackendError,
    ChoiceQuery,
    ChoiceScores,
    GenerationRequest,
    Generations,
    register_backend,
)
from rlens.records.recorded import RecordedDataset


@register_backend("replay")
class ReplayBackend(Backend):
    blocking = False

    def __init__(self, dataset: RecordedDataset, model: int | str):
        self.dataset = dataset
        self.model = dataset.model_names.index(model) if isinstance(model, str) else int(model)
        if not 0 <= self.model < dataset.n_models:
            raise ValueError(f"model index {self.model} is outside the dataset's {dataset.n_models} models")
        self._answers: dict[int, ChoiceScores] = {}  # question index -> its answer, built on first use

    def _row(self, query_id: str) -> int:
        try:
            row = int(query_id)
        except ValueError:
            raise BackendError(f"replay backend: query id {query_id!r} is not a question index") from None
        if not 0 <= row < self.dataset.n_questions:
            raise BackendError(f"replay backend: no recorded question {row} (dataset has {self.dataset.n_questions})")
        return row

    def generate(self, request: GenerationRequest) -> Generations:
        if self.dataset.sampled is None:
            raise BackendError(
                f"replay backend: dataset {self.dataset.name} records choice probabilities, not samples (no {request.id!r} texts to replay)"
            )
        texts = self.dataset.sampled[self._row(request.id)].samples.get(self.dataset.model_names[self.model], [])
        return Generations(texts=texts[: request.n])

    def probe_query(self) -> ChoiceQuery:
        """The dataset's first question, with as many (placeholder) choices as it has recorded."""
        n = int(self.dataset.choice_mask[0].sum())
        return ChoiceQuery(id="0", prompt="(recorded question 0)", choices=[f"choice {i}" for i in range(n)])

    def score_choices(self, query: ChoiceQuery) -> ChoiceScores:
        row = self._row(query.id)
        answer = self._answers.get(row)
        if answer is None:
            answer = self._answers[row] = recorded_scores(self.dataset, row, self.model)
        if len(answer.loglikelihoods) != len(query.choices):
            raise BackendError(
                f"replay backend: question {row} has {len(answer.loglikelihoods)} recorded choices, the query {len(query.choices)}"
            )
        return answer


def recorded_scores(dataset: RecordedDataset, row: int, model: int) -> ChoiceScores:
    """Question ``row``'s recorded answer of model ``model``: log-probabilities, and the most probable as greedy."""
    probs = dataset.probs[row, model, dataset.choice_mask[row]].astype(np.float64)
    best = probs.argmax()
    # built from the dataset's own arrays, already of the right types: no validation needed
    return ChoiceScores.model_construct(
        loglikelihoods=np.log(np.maximum(probs, 1e-30)).tolist(),
        is_greedy=[bool(i == best) for i in range(len(probs))],
    )
