"""rlens: streaming LLM ensembles that keep learning from feedback (RL-Focal, RLAE)."""

__version__ = "0.1.0"
