"""``python -m l2l`` (also what ``torchrun -m l2l`` runs)."""
import sys

from .cli import main

sys.exit(main())
