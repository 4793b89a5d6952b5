"""trtbuild.builder.emit"""
