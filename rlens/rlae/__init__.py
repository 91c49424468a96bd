"""RLAE: an RL agent sets the weights of several LLMs span by span while they generate, and their next-token
distributions are merged over a union vocabulary."""
