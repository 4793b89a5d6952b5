"""``trtbuild plan``: memory, build cost and speed estimates before building, and their text."""
