"""The model side: pool files, calling a pool concurrently, answer parsing, and `rlens serve-model`."""
