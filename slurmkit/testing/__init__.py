"""Helpers for tests and tools that start real local services (S3 server)."""
