"""Delay, schedule and TTL logic of dapr-delayed-pubsub, free of gRPC.

Components (the gRPC server and its Redis Streams broker) import this package;
nothing here imports them.
"""
