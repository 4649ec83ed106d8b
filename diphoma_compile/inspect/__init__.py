"""``diphoma inspect``: plan a model file for a mesh without devices (framework-neutral)."""
