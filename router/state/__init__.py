"""Model state: the configured models and what keeps them loaded.

Owns the registry of models (``registry``: each model's spec, procman backend, admission
``limits`` and suspect ``lane``, bundled as ``model.Model``), how a model becomes a procman
``BackendSpec`` (``launch``), memory claims, budgets, measured sizes and evictions
(``residency``, ``budget``, ``sizes``, ``memwatch``) and device health (``devices``).

Imports: ``router.edge``, the root's ``config``, ``reload`` and ``metrics``, procman and
``modelserver.spec``. Never ``router.path`` or ``router.api``: requests and routes read the
state, the state never reaches up to them. ``model.py`` holds the types its modules share,
so ``residency`` reads the registry through ``model.Fleet`` instead of importing it.
"""
