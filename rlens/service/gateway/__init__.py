"""The OpenAI-compatible HTTP gateway in front of the Kafka service."""
