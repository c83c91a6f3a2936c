"""Helpers the tests share (never imported from another test file)."""
