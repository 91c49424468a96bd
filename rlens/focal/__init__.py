"""RL-Focal: pure algorithm code (metrics, windows, agents, MAPPO, schedule); no I/O."""
