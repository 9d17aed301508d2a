"""Speculative decoding: proposers guess the next tokens, one forward pass of the model checks
them all, and the acceptance rule keeps exactly what plain decoding would have produced.

- ``proposer.py``: the ``Proposer`` interface and what a proposal carries.
- ``ngram.py``: prompt lookup (the continuation of the latest earlier match of the request's own
  last n-gram); ``grammar.py``: grammar-forced text (jump-forward); ``draft_model.py``: a smaller
  model with the same tokenizer, or this model's first layers (``self:K``).
- ``verify.py``: the one acceptance rule every proposer shares.
- ``adaptive.py``: per-request draft length from recent acceptance, the batch-size off-switch.
- ``speculator.py``: ties them to the engine's step (attach drafts, accept, count).
"""
