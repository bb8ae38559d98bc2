"""Tests of cacheroute."""
