"""Metrics (metrics.py: prometheus_client's multiprocess mode) and tracing (tracing.py, and otel.py
with --otlp-endpoint). Imports nothing else of server/.
"""
