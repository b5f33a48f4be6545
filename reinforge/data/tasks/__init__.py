"""Built-in tasks that generate their own data (no download needed)."""
