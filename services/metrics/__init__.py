"""Prometheus metrics under vLLM's names (multiprocess mode), and the periodic stats log line."""
