"""Pipeline stages: the head (stage 0: requests, scheduling, sampling, the first layers) and the stages after it."""
