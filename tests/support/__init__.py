"""Test support: fixtures and helpers shared by tests and benchmarks; never imported by runtime code."""
