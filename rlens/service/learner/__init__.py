"""The learner: joins experience with feedback, keeps the windows, trains online, checkpoints and publishes
policies (``core``: the joining; ``online``: the trainers; ``app``: the process)."""
