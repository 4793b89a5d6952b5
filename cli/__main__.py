"""``python -m trtbuild.cli``: what torchrun and the tests start (the ``trtbuild`` script's twin)."""
from .main import main

main()
