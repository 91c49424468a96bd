"""What every service process shares: Kafka topics and publishing, policies and their signatures, the Redis
windows, metrics and health routes, logging."""
