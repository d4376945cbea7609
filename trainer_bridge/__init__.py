"""The trainer bridge: task dispatch, GRPO, backends, weight publishing, the policy server.

Submodules import torch only where they train or serve; importing this package does not.
"""
