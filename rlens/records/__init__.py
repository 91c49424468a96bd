"""What rlens records and reads back, at the bottom of the package: recorded datasets (choice probabilities and
open-ended samples) and answer parsing. It imports nothing of rlens above it."""
