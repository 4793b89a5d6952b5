"""The deployment spec: the YAML document, its checks against the checkpoint, its resolution."""
