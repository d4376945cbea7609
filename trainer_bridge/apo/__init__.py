"""Automatic prompt optimization (``algorithm: apo``): a beam search over each selected agent's
instructions, scored through the loop's runners and rewards, with an optimizer model's critiques
and edits (docs/apo.md). ``config`` (the ``apo:`` block), ``search`` (the beam), ``rounds`` (the
candidates' rollouts), ``optimizer`` (the optimizer model), ``rollout_text`` (what it reads),
``run`` (all of it for ``spanrl train``). Torch-free.
"""
