"""Living with checkpoints: the CLI, inspect, export and import."""
