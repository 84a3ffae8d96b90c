"""``python -m lorapack.cli``."""

from . import main

main()
