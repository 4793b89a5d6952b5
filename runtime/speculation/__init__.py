"""Speculative decoding: Medusa trees, host draft sources (prompt lookup, suffix) and their chains,
the policies that decide per batch what to verify, and the step times they share."""
