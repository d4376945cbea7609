"""``python -m spanrl`` runs the ``spanrl`` console script."""

import sys

from spanrl.cli import main

sys.exit(main())
