"""``spanrl dashboard``: a read-only web app over a span store and a training run (docs/dashboard.md)."""
