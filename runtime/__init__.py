"""trtbuild.runtime: serves engine dirs built by trtbuild.builder (shares only the manifest format)."""
