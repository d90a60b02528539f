"""One training step's pieces, apart from Lightning: the experience (rollout, rewards, advantages: ``experience.py``,
``advantages.py``), the scoring passes (``logprobs.py``, ``entropy.py``) and the KL reference (``reference.py``), and
the update that turns them into optimizer steps (``update.py``) over the loop that runs it (``loop.py``: Lightning's or
plain PyTorch's). Nothing here imports the module or a Trainer."""
