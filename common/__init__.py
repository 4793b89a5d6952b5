"""Small helpers that builder, runtime, checkpoint and contract all use and none of them owns: a
child process that dies with its parent, and an exception told in one line. Imports no other
trtbuild package."""
