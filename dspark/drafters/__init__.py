"""Drafters: small networks that propose tokens for a target (one folder per drafter)."""
