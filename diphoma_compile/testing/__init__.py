"""Helpers for the project's tests, usable by users' tests too."""
