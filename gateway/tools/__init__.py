"""Operator tools beside the fronts: capture, verify, decode, load, stats and vbucket commands."""
