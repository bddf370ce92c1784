"""Prefect flows (thin orchestration over tasks/) and the `kvcompress` command line."""
