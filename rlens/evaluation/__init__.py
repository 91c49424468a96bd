"""Offline evaluation: recorded-outputs datasets, the paper's protocols, the replay harness, baselines, reports."""
