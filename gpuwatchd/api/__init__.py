"""The read-only JSON documents the daemon serves: each one's producer and parser live together."""
