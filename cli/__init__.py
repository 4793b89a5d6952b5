"""The ``trtbuild`` command line, above the builder and the runtime: it imports both."""
