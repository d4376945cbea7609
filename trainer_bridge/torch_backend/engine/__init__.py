"""The embedded policy engine: one scheduler thread batches generation requests on the model.

``policy_engine.py`` is its public face; ``scheduler.py`` (queue, admission, step loop),
``kv_cache.py`` (the running batch; ``growing_cache.py``: its cache layers), ``sampling.py`` and
``detokenize.py`` do the work.
``requests.py`` holds the torch-free request types shared with the HTTP front end;
``link.py`` carries them between the engine's process and the front end's (``wire.py``: the frames).
"""
