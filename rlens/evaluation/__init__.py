"""Offline evaluation: the paper's protocols, the replay harness, baselines, RLAE's evaluation, reports (the
recorded datasets' formats are in :mod:`rlens.records`)."""
