"""Prefect flows (thin orchestration over the tasks of `kvcompress_tasks`) and the `kvcompress` command
line. Installed as `kvcompress_flows` (the folder keeps its name; nothing installs a package `flows`)."""
