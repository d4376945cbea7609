"""The embedded policy engine: one scheduler thread batches generation requests on the model.

``requests.py`` holds the torch-free request types shared with the HTTP front end;
``link.py`` carries them between the engine's process and the front end's.
"""
