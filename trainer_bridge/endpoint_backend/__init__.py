"""``backend: endpoint``: an endpoint spanrl does not train (``endpoint_backend/backend.py``)."""
