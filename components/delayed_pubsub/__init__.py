"""Dapr pluggable pub/sub component: a pubsub.redis-compatible Redis Streams broker served over gRPC."""
