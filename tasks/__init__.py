"""Prefect tasks, thin wrappers over the library (`kvcompress`) and the reports layer
(`kvcompress_reports`). Installed as `kvcompress_tasks` (the folder keeps its name; nothing
installs a package `tasks`)."""
