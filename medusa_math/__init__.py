"""Medusa acceptance arithmetic shared by the build's plan and the runtime's speculation policy."""
