"""What the passes decided, read off the final graph: the plan, its text, memory reports."""
