"""trtbuild.builder.frontend"""
