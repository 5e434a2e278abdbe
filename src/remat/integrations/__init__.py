"""remat inside the frameworks users train with (docs/integrations.md and its pages).

One module per framework; each imports its framework only when used, so ``import remat``
never needs them. All of them go through :func:`remat.auto_checkpoint`.
"""
