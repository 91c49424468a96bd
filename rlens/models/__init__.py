"""The model side: pool files, calling a pool concurrently, and `rlens serve-model` (answer parsing is in
:mod:`rlens.records.answers`)."""
