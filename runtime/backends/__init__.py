"""Engine backends' own code (what only one backend needs)."""
