"""A small package laid out like transformers: a config module and a modeling module that
imports it relative to the package."""
