"""Prefect tasks wrapping the kvcompress library (kept thin: the science lives in kvcompress/)."""
